"""Embeddings read by rows (``execution.embedding_rows``): only the rows a batch names are read, the outputs and the
checkpoint are those of the whole table, and the checkpoint copies the weight from its file in pieces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

import seqcal.plan as plan_module
from seqcal.checkpoint.shard_file import _ShardFile
from seqcal.entrypoint import oneshot
from seqcal.execution import embedding_rows, head_rows, pipeline
from seqcal.execution.store import WeightStore
from seqcal.execution.weights import safety_hooks
from seqcal.modifiers import GPTQModifier
from seqcal.plan import make_plan
from seqcal.sources.files import FileCopy

RECIPE = "GPTQModifier: {scheme: W4A16, ignore: [lm_head]}"
VOCAB = 512


def data() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, VOCAB, (24,), generator=g).tolist()} for _ in range(4)]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=request.param,
                         pad_token_id=VOCAB - 1)  # fmt: skip
    path = tmp_path_factory.mktemp("model")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def test_rows_are_the_whole_tables_rows(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(50, 7, generator=g).to(torch.bfloat16),
        "f32": torch.randn(50, 3, 2, generator=g),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    rows = torch.tensor([0, 1, 2, 9, 30, 31, 49])
    for dtype in (None, torch.float32, torch.bfloat16):
        store = WeightStore(files=dict.fromkeys(tensors, str(tmp_path / "t.safetensors")), dtype=dtype)
        for name in tensors:
            got, want = store.read_rows(name, rows), store.read(name).index_select(0, rows)
            assert got.dtype == want.dtype and torch.equal(got, want), (name, dtype)
    store.overrides["f32"] = torch.zeros(50, 3, 2)  # a changed weight: its rows come from the override
    assert store.stored_in_file("f32") is None and torch.equal(
        store.read_rows("f32", rows), torch.zeros(7, 3, 2)
    )
    assert store.read_rows("bf16", torch.tensor([], dtype=torch.int64)).shape == (0, 7)


def test_file_copy_casts_piece_by_piece(tmp_path: Path) -> None:
    weight = torch.randn(33, 5).to(torch.bfloat16)
    save_file({"w": weight}, tmp_path / "t.safetensors")
    for dtype in (torch.bfloat16, torch.float32):
        shard = _ShardFile(tmp_path / f"{dtype}.safetensors")
        shard.add_pieces(
            "w", *FileCopy(str(tmp_path / "t.safetensors"), "w", dtype).pieces(64)
        )  # 3 pieces at least
        shard.finish({"format": "pt"})
        store = WeightStore(files={"w": str(shard.path)})
        assert torch.equal(store.read("w"), weight.to(dtype)), dtype
    with pytest.raises(ValueError, match="cannot be copied in pieces"):
        FileCopy(str(tmp_path / "t.safetensors"), "w", torch.float32).pieces(63)


def test_a_lookup_reads_only_its_rows(tmp_path: Path) -> None:
    whole = torch.nn.Embedding(40, 6, padding_idx=39)
    save_file({"weight": whole.weight.detach().clone()}, tmp_path / "e.safetensors")
    store = WeightStore(files={"weight": str(tmp_path / "e.safetensors")})
    lazy = torch.nn.Embedding(40, 6, padding_idx=39, device="meta")
    meta = lazy.weight
    ids = torch.tensor([[3, 39, 3, 17], [0, 5, 5, 38]])
    reads = []
    store.read = lambda name: reads.append(name)  # the whole table is never read
    with torch.no_grad(), safety_hooks(lazy, store, torch.device("cpu")):
        got = lazy(ids)
    assert torch.equal(got, whole(ids).detach()) and not reads
    assert lazy.weight is meta and lazy.padding_idx == 39  # put back after the call
    assert (
        embedding_rows.lookup(lazy, "", store, torch.device("cpu"), (torch.tensor([40]),)) is None
    )  # outside


def test_oneshot_by_rows_writes_the_same_checkpoint(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read, rows = [], []
    real_read, real_rows = WeightStore.read, WeightStore.read_rows

    def spy_read(self: WeightStore, name: str) -> torch.Tensor:
        read.append(name)
        return real_read(self, name)

    def spy_rows(self: WeightStore, name: str, ids: torch.Tensor) -> torch.Tensor:
        rows.append(name)
        return real_rows(self, name, ids)

    monkeypatch.setattr(WeightStore, "read", spy_read)
    monkeypatch.setattr(WeightStore, "read_rows", spy_rows)
    oneshot(model=str(model_dir), dataset=data(), recipe=RECIPE, output_dir=str(tmp_path / "rows"))
    assert "model.embed_tokens.weight" not in read and "model.embed_tokens.weight" in rows
    monkeypatch.setattr(pipeline, "mark_by_rows", lambda *args: None)  # every weight onloaded whole
    oneshot(model=str(model_dir), dataset=data(), recipe=RECIPE, output_dir=str(tmp_path / "whole"))
    files = sorted(p.name for p in (tmp_path / "rows").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp_path / "whole").glob("*.safetensors"))
    for name in files:
        assert (tmp_path / "rows" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_the_plan_leaves_the_table_out(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = LlamaConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    kwargs = dict(num_samples=4, seq_len=24, batch_size=1, sequential_targets=None, tracing_ignore=[])
    gptq = GPTQModifier(scheme="W4A16", ignore=["lm_head"])
    by_rows = make_plan(model, [gptq], **kwargs).rows[0]
    monkeypatch.setattr(plan_module, "mark_by_rows", lambda *args: None)
    whole = make_plan(model, [gptq], **kwargs).rows[0]
    assert whole.weights - by_rows.weights == (VOCAB - 24) * 128 * 2  # the table less a row per token, bf16


def test_a_transform_reads_the_table_whole(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marked: list[list[str]] = []

    def mark(model: torch.nn.Module, subgraphs: list, modifiers: list) -> None:
        embedding_rows.mark_by_rows(model, subgraphs, modifiers)
        marked.extend(sg.by_rows for sg in subgraphs)

    monkeypatch.setattr(pipeline, "mark_by_rows", mark)
    oneshot(model=str(model_dir), dataset=data(), recipe=RECIPE, output_dir=str(tmp_path / "gptq"))
    assert ["model.embed_tokens"] in marked
    marked.clear()
    recipe = "SmoothQuantModifier: {smoothing_strength: 0.5}\nGPTQModifier: {scheme: W8A8, ignore: [lm_head]}"
    oneshot(model=str(model_dir), dataset=data(), recipe=recipe, output_dir=str(tmp_path / "smooth"))
    assert marked and not any(marked)  # SmoothQuant transforms weights: every one onloaded whole


def test_a_failed_call_puts_the_weight_back(tmp_path: Path) -> None:
    save_file({"weight": torch.randn(10, 4)}, tmp_path / "e.safetensors")
    store = WeightStore(files={"weight": str(tmp_path / "e.safetensors")})
    lazy = torch.nn.Embedding(10, 4, device="meta")
    meta = lazy.weight

    def fail(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        raise RuntimeError("later in the forward")

    lazy.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="later"), safety_hooks(lazy, store, torch.device("cpu")):
        lazy(torch.tensor([1, 2]))
    assert lazy.weight is meta


def test_which_embeddings_only_look_up() -> None:
    from transformers.models.bart.modeling_bart import BartLearnedPositionalEmbedding, BartScaledWordEmbedding
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    assert embedding_rows.reads_rows(torch.nn.Embedding(4, 2))
    assert not embedding_rows.reads_rows(torch.nn.Embedding(4, 2, max_norm=1.0))  # it writes the table
    assert embedding_rows.reads_rows(Gemma3TextScaledWordEmbedding(8, 4, 0, embed_scale=2.0))
    assert embedding_rows.reads_rows(BartScaledWordEmbedding(8, 4, 0))
    assert not embedding_rows.reads_rows(
        BartLearnedPositionalEmbedding(8, 4)
    )  # positions, not its input's rows

    class Shifted(torch.nn.Embedding):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return super().forward(input_ids + 1)

    assert not embedding_rows.reads_rows(Shifted(8, 4))


def test_a_scaled_embedding_by_rows(tmp_path: Path) -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    whole = Gemma3TextScaledWordEmbedding(30, 4, 0, embed_scale=3.0)
    save_file({"weight": whole.weight.detach().clone()}, tmp_path / "e.safetensors")
    store = WeightStore(files={"weight": str(tmp_path / "e.safetensors")})
    with torch.device("meta"):
        lazy = Gemma3TextScaledWordEmbedding(30, 4, 0, embed_scale=3.0)
    lazy.embed_scale = whole.embed_scale.clone()  # a buffer: real, as load_offloaded keeps buffers
    ids = torch.tensor([[0, 7, 7, 29]])
    with torch.no_grad(), safety_hooks(lazy, store, torch.device("cpu")):
        assert torch.equal(lazy(ids), whole(ids).detach())


def test_a_large_head_is_read_by_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_rows, "HEAD_BYTES", 1024)
    monkeypatch.setattr(head_rows, "CHUNK_BYTES", 7 * 16 * 4)  # 7 rows a chunk: 50 rows in 8 chunks
    whole = torch.nn.Linear(16, 50)
    save_file(
        {"weight": whole.weight.detach().clone(), "bias": whole.bias.detach().clone()},
        tmp_path / "h.safetensors",
    )
    store = WeightStore(files=dict.fromkeys(["weight", "bias"], str(tmp_path / "h.safetensors")))
    lazy = torch.nn.Linear(16, 50, device="meta")
    reads: list[int] = []
    real_rows = WeightStore.read_rows
    monkeypatch.setattr(
        WeightStore, "read_rows", lambda self, n, ids: reads.append(len(ids)) or real_rows(self, n, ids)
    )
    x = torch.randn(3, 5, 16)
    with torch.no_grad(), safety_hooks(lazy, store, torch.device("cpu")):
        got = lazy(x)
    assert torch.allclose(got, whole(x), atol=1e-6) and got.shape == (3, 5, 50)
    assert reads == [7] * 7 + [1] and lazy.weight.device.type == "meta" and "forward" not in lazy.__dict__
    onloaded = torch.nn.Linear(16, 50)  # a head onloaded runs its own forward
    with torch.no_grad(), safety_hooks(onloaded, store, torch.device("cpu")):
        assert torch.equal(onloaded(x), torch.nn.functional.linear(x, onloaded.weight, onloaded.bias))


def test_a_converted_weight_on_meta_is_onloaded_for_its_write(tmp_path: Path) -> None:
    """A key conversion that computes a module's tensor from its weight (not the parameter itself) gets the
    module onloaded, not a file copy of a tensor it would not write."""
    import contextlib

    from seqcal.checkpoint.host_tensors import module_tensors_for_write

    weight = torch.randn(6, 4)
    save_file({"m.weight": weight}, tmp_path / "w.safetensors")
    store = WeightStore(files={"m.weight": str(tmp_path / "w.safetensors")})
    model = torch.nn.Module()
    model.m = torch.nn.Linear(4, 6, bias=False, device="meta")

    class Weights:  # SubgraphWeights' two members the write reads
        def __init__(self) -> None:
            self.store = store

        @contextlib.contextmanager
        def modules_onloaded(self, names: list[str]):  # noqa: ANN202
            for n in names:
                model.get_submodule(n).weight = torch.nn.Parameter(store.read(f"{n}.weight"))
            yield
            for n in names:
                model.get_submodule(n).weight = torch.nn.Parameter(torch.empty(6, 4, device="meta"))

    class Writer:  # stores the weight transposed, as a key conversion might
        def module_tensors(
            self, name: str, module: torch.nn.Module, quantized: object
        ) -> dict[str, torch.Tensor]:
            return {f"{name}.weight_t": module.weight.t().contiguous()}

    copied = module_tensors_for_write(Writer(), Weights(), model, ["m"], {})
    assert torch.equal(copied[0]["m.weight_t"], weight.t())
    plain = module_tensors_for_write(CheckpointWriterLike(), Weights(), model, ["m"], {})
    assert isinstance(plain[0]["m.weight"], FileCopy)


class CheckpointWriterLike:
    def module_tensors(
        self, name: str, module: torch.nn.Module, quantized: object
    ) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": module.weight}
