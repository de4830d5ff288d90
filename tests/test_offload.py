"""Weights stay where they are: offloaded (per-subgraph) calibration equals in-memory calibration bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from save_helpers import checkpoint_tensors
from seqcal.checkpoint.preflight import DiskSpaceError, check_environment, check_output_dir
from seqcal.entrypoint import oneshot
from seqcal.execution.store import load_offloaded
from seqcal.execution.weights import params_under

RECIPE = "GPTQModifier: {scheme: W4A16, ignore: [lm_head]}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    path = tmp_path_factory.mktemp("model")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def data() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(3)
    return [
        {"input_ids": (torch.randint(-3, 4, (40,), generator=g).cumsum(0) % 256).tolist()} for _ in range(8)
    ]


def test_offloaded_run_equals_in_memory_run(model_dir: Path, tmp_path: Path) -> None:
    offloaded = oneshot(model=str(model_dir), dataset=data(), recipe=RECIPE, output_dir=str(tmp_path / "a"))
    assert all(p.device.type == "meta" for p in offloaded.parameters())  # nothing was kept in RAM
    # Where CUDA is, the offloaded run executes there: the in-memory run must too to compare bit for bit.
    in_memory = (
        AutoModelForCausalLM.from_pretrained(model_dir)
        .eval()
        .to("cuda" if torch.cuda.is_available() else "cpu")
    )
    oneshot(model=in_memory, dataset=data(), recipe=RECIPE, output_dir=str(tmp_path / "b"))
    a, b = checkpoint_tensors(tmp_path / "a"), checkpoint_tensors(tmp_path / "b")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_load_offloaded_reads_nothing_until_asked(model_dir: Path) -> None:
    model, store = load_offloaded(model_dir)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert store.aliases == {
        "lm_head.weight": "model.embed_tokens.weight"
    }  # tied: read under the stored name
    names = params_under(model, ["model.layers.1"])
    assert names and all(n.startswith("model.layers.1.") for n in names)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert torch.equal(
        store.read("model.layers.1.mlp.up_proj.weight"), reference["model.layers.1.mlp.up_proj.weight"]
    )


def test_preflight_refuses_bad_environments(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        check_output_dir(str(tmp_path / "full"), overwrite=False, resume=False)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not __import__("os").access(locked, __import__("os").W_OK):  # root can write anywhere: skip then
        with pytest.raises(PermissionError, match="not writable"):
            check_output_dir(str(locked / "out"), overwrite=False, resume=False)
    model, _ = load_offloaded(model_dir)
    huge = torch.nn.Module()
    huge.register_parameter("w", torch.nn.Parameter(torch.empty(10**15, device="meta")))
    with pytest.raises(DiskSpaceError, match="GB are free"):
        check_environment(huge, [], str(tmp_path / "out"), "cpu", None)
    with pytest.raises(PermissionError, match="offload_dir"):
        check_environment(model, [], None, "disk", str(tmp_path / "missing"))


@pytest.mark.parametrize("tie", [False, True])
def test_staged_in_memory_model_equals_the_plain_in_memory_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tie: bool
) -> None:
    """A model in RAM is staged through the execution device (the GPU path) with the same result."""
    import seqcal.execution.pipeline

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)  # fmt: skip
    plain, staged = LlamaForCausalLM(config).eval(), LlamaForCausalLM(config).eval()
    staged.load_state_dict(plain.state_dict())
    oneshot(model=plain, dataset=data(), recipe=RECIPE, output_dir=str(tmp_path / "plain"))
    monkeypatch.setattr(seqcal.execution.pipeline, "_stage", lambda model, args: True)
    real, staged_models = seqcal.execution.pipeline.stage_in_memory, []
    monkeypatch.setattr(
        seqcal.execution.pipeline, "stage_in_memory", lambda m: staged_models.append(m) or real(m)
    )
    oneshot(model=staged, dataset=data(), recipe=RECIPE, output_dir=str(tmp_path / "staged"))
    assert staged_models == [staged]
    a, b = checkpoint_tensors(tmp_path / "plain"), checkpoint_tensors(tmp_path / "staged")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the model given comes back whole: quantized weights in place, on cpu, tied weights one object again
    assert all(p.device.type == "cpu" for p in staged.parameters())
    want = dict(plain.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in staged.named_parameters())
    assert (staged.lm_head.weight is staged.model.embed_tokens.weight) == tie


def test_where_a_run_executes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA: weights off the model (a directory, or a model in RAM, staged) run on cuda; else where they are."""
    from seqcal.execution.pipeline import PipelineArgs, _execution_device, _stage
    from seqcal.execution.store import WeightStore

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    store = WeightStore(files={})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not _stage(model, PipelineArgs()) and _stage(model, PipelineArgs(stage_weights=True))
    assert _execution_device(model, store).type == "cpu" and _execution_device(model, None).type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _stage(model, PipelineArgs()) and not _stage(model, PipelineArgs(stage_weights=False))
    assert _execution_device(model, store).type == "cuda"
    assert _execution_device(model, None).type == "cpu"  # not staged: runs where its weights are


def test_a_tokenizer_oneshot_loaded_is_not_held_during_calibration(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its RSS (53 MB for SmolLM2's) would count against the memory bound; it is read again for the save."""
    import gc
    import shutil

    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    from seqcal.execution.weights import SubgraphWeights

    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = tmp_path / "model"
    LlamaForCausalLM(config).save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, model / name)
    alive: list[bool] = []
    real = SubgraphWeights.onload

    def onload(self: SubgraphWeights, sg: object) -> int:
        gc.collect()
        alive.append(any(isinstance(o, PreTrainedTokenizerBase) for o in gc.get_objects()))
        return real(self, sg)

    monkeypatch.setattr(SubgraphWeights, "onload", onload)
    texts = ["The history of the city begins with a small settlement on the river.", "Light is energy."]
    # the embeddings outweigh these tiny layers, so the layers are named rather than inferred
    oneshot(model=str(model), dataset=texts, recipe=RECIPE, output_dir=str(tmp_path / "out"), max_seq_length=32,
            sequential_targets=["LlamaDecoderLayer"])  # fmt: skip
    assert alive and not any(alive)  # no tokenizer object while subgraphs run
    saved = AutoTokenizer.from_pretrained(tmp_path / "out")  # still saved with the checkpoint
    assert (
        saved("Light is energy.")["input_ids"]
        == AutoTokenizer.from_pretrained(model)("Light is energy.")["input_ids"]
    )
