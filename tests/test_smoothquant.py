"""SmoothQuant: the math (llm-compressor's formula), the fold (the float model is unchanged), the coordinates
of accumulated statistics (H' = S^-1 H S^-1), the pipeline order (transforms before quantizers), errors before
calibration, and llm-compressor's SmoothQuant + GPTQ W8A8 recipe end to end (saved, reloaded in transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seqcal import oneshot
from seqcal.algorithms import accumulate_hessian
from seqcal.algorithms.smoothing import smoothed_hessian, smoothing_scales, update_channel_range
from seqcal.execution.transforms import linear_graph
from seqcal.mappings import Mapping, derive_mappings, fold_scales
from seqcal.modifiers import GPTQModifier, RunState, SmoothQuantModifier
from seqcal.modifiers.base import Batch, Fold
from seqcal.recipe.parse import parse_recipe
from zoo import ARCHS

ROOT = Path(__file__).resolve().parent.parent
LLMC = [
    [["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
    [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"],
]


def test_scales_follow_llm_compressors_formula_with_its_clamps() -> None:
    lo, hi = torch.tensor([-1.0, 0.0, -2.0, 0.0]), torch.tensor([3.0, 0.0, 2.0, 5.0])
    W1 = torch.tensor([[0.5, 1.0, -2.0, 0.0], [0.1, 0.2, 0.3, 0.0]])
    W2 = torch.tensor([[-1.0, 0.1, 0.1, 0.0]])
    s = smoothing_scales((lo, hi), [W1, W2], 0.8)
    act, w = hi - lo, 2.0 * torch.tensor([1.0, 1.0, 2.0, 0.0])
    want = act**0.8 / w**0.2
    want[3] = act[3]  # a zero weight column: the activation range itself
    want[1] = 1e-5  # a dead channel: the lower clamp
    assert torch.allclose(s, want)


def test_channel_range_is_running_min_max() -> None:
    a, b = torch.randn(5, 3), torch.randn(7, 3)
    lo, hi = update_channel_range(update_channel_range(None, a), b)
    assert torch.equal(hi, torch.cat([a, b]).amax(0)) and torch.equal(lo, torch.cat([a, b]).amin(0))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fold_leaves_the_float_model_unchanged(arch: str) -> None:
    spec = ARCHS[arch]
    model = spec.build()
    inputs = spec.make_inputs(model, batch=2, seq_len=10)
    with torch.no_grad():
        before = model(**inputs).logits
        mappings, _ = derive_mappings(model, linear_graph(model, {**inputs, "use_cache": False}))
        assert {m.kind for m in mappings} == {"norm", "linear"}
        gen = torch.Generator().manual_seed(0)
        for m in mappings:
            width = model.get_submodule(m.consumers[0]).in_features
            fold_scales(model, m, torch.rand(width, generator=gen) * 4 + 0.25)
        after = model(**inputs).logits
    assert not torch.equal(
        model.model.layers[0].input_layernorm.weight, spec.build().model.layers[0].input_layernorm.weight
    )
    assert (after - before).abs().max() <= 1e-5 * before.abs().max()


def test_hessian_of_smoothed_inputs_is_the_transformed_hessian() -> None:
    X, s = torch.randn(3, 40, 24, dtype=torch.float64).float(), torch.rand(24) * 3 + 0.1
    H, _ = accumulate_hessian(None, X, 0)
    H_smooth, _ = accumulate_hessian(None, X / s, 0)
    assert torch.allclose(smoothed_hessian(H, s), H_smooth, rtol=1e-5, atol=1e-6)


def _gptq_with_hessian(model: torch.nn.Module, x: torch.Tensor, scheme: str) -> tuple[GPTQModifier, RunState]:
    gptq = GPTQModifier(scheme=scheme, ignore=["lm_head"])
    state = RunState()
    gptq.initialize(model, state)
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    gptq.observe(names, x, state, Batch())
    return gptq, state


def test_gptq_moves_its_accumulated_hessian_on_a_fold() -> None:
    model = ARCHS["llama"].build()
    x, s = torch.randn(2, 9, 64), torch.rand(64) + 0.5
    gptq, state = _gptq_with_hessian(model, x, "W8A8")
    mapping = Mapping(
        "model.layers.0.input_layernorm", tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv"), "norm"
    )
    gptq.on_fold(Fold(mapping, s), model, state)
    want, _ = accumulate_hessian(None, x / s, 0)
    got = gptq._inputs.acc[mapping.consumers[0]].H.clone()
    if gptq._inputs.acc[mapping.consumers[0]].upper:  # CPU accumulates the upper triangle only
        got, want = torch.triu(got), torch.triu(want)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_fold_after_static_observers_saw_inputs_is_refused() -> None:
    model = ARCHS["llama"].build()
    gptq, state = _gptq_with_hessian(model, torch.randn(2, 9, 64), "W8A8")
    static = parse_recipe(ROOT / "recipes" / "gptq_w8a8_static.yaml").modifiers[0]
    static.initialize(model, state)
    static.observe(
        [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"], torch.randn(2, 9, 64), state, Batch()
    )
    mapping = Mapping("model.layers.0.input_layernorm", ("model.layers.0.self_attn.q_proj",), "norm")
    with pytest.raises(RuntimeError, match="after its static input observer saw inputs"):
        static.on_fold(Fold(mapping, torch.ones(64)), model, state)


def test_llmc_recipes_parse_with_their_mappings() -> None:
    recipe = parse_recipe(ROOT / "recipes" / "smoothquant_gptq_w8a8.yaml")
    sq, gptq = recipe.modifiers
    assert isinstance(sq, SmoothQuantModifier) and isinstance(gptq, GPTQModifier)
    assert sq.smoothing_strength == 0.8 and sq.mappings == LLMC


def test_bad_mappings_and_arguments_fail_before_calibration(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"smoothing_strength must be a number in \[0, 1\], got 1.5"):
        SmoothQuantModifier(smoothing_strength=1.5)
    model = ARCHS["llama"].build()
    bad = SmoothQuantModifier(mappings=[[["re:.*q_projj"], "re:.*input_layernorm"]])
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(
        ValueError, match=r"'re:\.\*q_projj' matches no module of LlamaForCausalLM; fix the regex"
    ):
        oneshot(
            model=model,
            dataset=[{"input_ids": list(range(3, 20))}],
            recipe=[bad, GPTQModifier(scheme="W8A8")],
        )
    assert not calls  # refused before any forward pass


def _calibration() -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(3, 250, (16,), generator=gen).tolist()} for _ in range(4)]


def test_first_group_is_smoothed_with_the_float_inputs_range() -> None:
    """One-pass cut: the layer-0 q/k/v group reads float inputs, so its scales are those of a plain forward."""
    model, data = ARCHS["llama"].build(), _calibration()
    norm = model.model.layers[0].input_layernorm
    seen = []
    handle = norm.register_forward_hook(lambda mod, args, out: seen.append(out.reshape(-1, out.shape[-1])))
    with torch.no_grad():
        for row in data:
            model(input_ids=torch.tensor([row["input_ids"]]))
    handle.remove()
    X = torch.cat(seen)
    weights = [model.model.layers[0].self_attn.get_submodule(f"{p}_proj").weight.clone() for p in "qkv"]
    s = smoothing_scales((X.amin(0), X.amax(0)), weights, 0.8)
    want = norm.weight.detach() / s
    oneshot(model=model, dataset=data, recipe=[SmoothQuantModifier(smoothing_strength=0.8),
                                               GPTQModifier(scheme="W8A8", ignore=["lm_head"])])  # fmt: skip
    assert torch.allclose(norm.weight, want, rtol=1e-6)


def test_smoothquant_gptq_w8a8_recipe_runs_unchanged_saves_and_reloads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    spec = ARCHS["llama"]
    reference = spec.build()
    (tmp_path / "model").mkdir()
    reference.save_pretrained(tmp_path / "model")
    out = tmp_path / "out"
    model = oneshot(model=str(tmp_path / "model"), dataset=_calibration(), output_dir=str(out),
                    recipe=str(ROOT / "recipes" / "smoothquant_gptq_w8a8.yaml"))  # fmt: skip
    del model
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert "SmoothQuantModifier" in (out / "recipe.yaml").read_text()
    norm = loaded.model.layers[1].post_attention_layernorm.weight
    assert not torch.allclose(norm, reference.model.layers[1].post_attention_layernorm.weight)
    ids = torch.tensor([_calibration()[0]["input_ids"]])
    with torch.no_grad():
        got, want = loaded(input_ids=ids).logits, reference(input_ids=ids).logits
    assert ((got - want).norm() / want.norm()).item() < 0.05  # int8 weights and activations: close to float


def test_layer_cut_smoothing_alone_keeps_the_float_function() -> None:
    """With no quantizer the run cuts after layers: the transforms' own pass, then the fold; outputs unchanged."""
    spec = ARCHS["qwen2"]
    model = spec.build()
    ids = torch.tensor([_calibration()[0]["input_ids"]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    weight = model.model.layers[2].input_layernorm.weight.clone()
    oneshot(model=model, dataset=_calibration(), recipe=SmoothQuantModifier())
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert not torch.equal(model.model.layers[2].input_layernorm.weight, weight)
    assert (after - before).abs().max() <= 1e-5 * before.abs().max()


def _mha_llama() -> torch.nn.Module:
    """A tiny Llama without grouped kv heads, so that v_proj -> o_proj is a mapping too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).float().eval()


W4_ASYM_G32 = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                              "strategy": "group", "group_size": 32}}}  # fmt: skip


@pytest.mark.parametrize("scheme", ["W8A8", "w4_asym_g32"])
def test_one_pass_folds_into_quantized_producers_keeping_their_codes(tmp_path: Path, scheme: str) -> None:
    """v_proj and up_proj are quantized before o_proj's and down_proj's inputs are seen: the fold divides the scales
    of their rows and keeps their codes, and the model the run leaves is the checkpoint's, weight for weight."""
    from save_helpers import checkpoint_tensors, reload

    def quantizer() -> GPTQModifier:
        if scheme == "W8A8":
            return GPTQModifier(scheme="W8A8", ignore=["lm_head"])
        return GPTQModifier(config_groups=W4_ASYM_G32, ignore=["lm_head"])

    runs = {}
    v_to_o = [["re:.*o_proj"], "re:.*v_proj"]
    for name, mappings in (("graph", None), ("norms", LLMC), ("norms+vo", [*LLMC, v_to_o])):
        model = _mha_llama()
        oneshot(model=model, dataset=_calibration(), output_dir=str(tmp_path / name),
                recipe=[SmoothQuantModifier(smoothing_strength=0.8, mappings=mappings), quantizer()])  # fmt: skip
        runs[name] = (model, checkpoint_tensors(tmp_path / name))
    model, ours = runs["graph"]
    # each producer quantized from the same inputs in both runs (they differ in its fold and downstream of it)
    for producer, other in (
        ("model.layers.0.self_attn.v_proj", "norms"),
        ("model.layers.0.mlp.up_proj", "norms+vo"),
    ):
        theirs = runs[other][1]
        codes = "weight_packed" if scheme != "W8A8" else "weight"
        assert torch.equal(ours[f"{producer}.{codes}"], theirs[f"{producer}.{codes}"]), producer  # codes kept
        s = theirs[f"{producer}.weight_scale"].float() / ours[f"{producer}.weight_scale"].float()
        assert (s - 1).abs().max() > 0.05, producer  # smoothed: the scales of its rows divided by s
        if scheme != "W8A8":  # one s per row, every group of the row
            assert torch.allclose(s, s[:, :1].expand_as(s), rtol=1e-5), producer
            assert torch.equal(ours[f"{producer}.weight_zero_point"], theirs[f"{producer}.weight_zero_point"])
    loaded = dict(reload(tmp_path / "graph", dequantize=True).named_parameters())
    for key, value in model.named_parameters():
        assert torch.equal(value, loaded[key]), key


def test_formats_whose_codes_would_change_are_not_folded_into(caplog: pytest.LogCaptureFixture) -> None:
    """FP8 weights with one scale per tensor: up_proj -> down_proj is skipped in the one-pass cut (logged)."""
    model = _mha_llama()
    norm = model.model.layers[0].post_attention_layernorm.weight.clone()
    with caplog.at_level("INFO", logger="seqcal"):
        oneshot(model=model, dataset=_calibration(),
                recipe=[SmoothQuantModifier(smoothing_strength=0.8), GPTQModifier(scheme="FP8", ignore=["lm_head"])])  # fmt: skip
    assert (
        "not smoothing model.layers.0.mlp.down_proj: model.layers.0.mlp.up_proj is already quantized and one "
        "weight scale spans all its rows (strategy 'tensor')" in caplog.text
    )
    assert not torch.equal(model.model.layers[0].post_attention_layernorm.weight, norm)  # the norms still are


def test_refusals_of_a_fold_into_a_quantized_producer() -> None:
    """Codes stay valid only for per-row scales; keys and values already observed for KV-cache scales do not."""
    from save_helpers import SCHEMES, rtn

    v, up = "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.up_proj"
    model = _mha_llama()
    assert RunState().refold_refusal(model, v) is None  # not quantized: the plain fold
    state = rtn(model, SCHEMES["w8a16_channel"], [v, up])
    assert state.refold_refusal(model, v) is None and state.refold_refusal(model, up) is None
    state = state.with_config(
        kv_cache_scheme=SCHEMES["fp8_dynamic"].input_activations
    )  # any: the KV cache is quantized
    model.model.layers[0].self_attn.register_buffer("v_scale", torch.ones(1))
    assert "quantized KV cache of model.layers.0.self_attn" in state.refold_refusal(model, v)
    assert state.refold_refusal(model, up) is None
    tensor = rtn(_mha_llama(), SCHEMES["fp8_weight_only"], [up])
    assert "strategy 'tensor'" in tensor.refold_refusal(model, up)
    with pytest.raises(
        RuntimeError, match="up_proj is already quantized and one weight scale spans all its rows"
    ):
        tensor.fold(model, Mapping(up, ("model.layers.0.mlp.down_proj",), "linear"), torch.ones(128))


def test_experts_inside_opaque_code_leave_the_other_mappings(caplog: pytest.LogCaptureFixture) -> None:
    """A loop over experts stays opaque, so the experts get no mapping (said once); the attention norms are smoothed."""
    model = ARCHS["qwen3_moe"].build()
    norm = model.model.layers[1].input_layernorm.weight.clone()
    with caplog.at_level("INFO", logger="seqcal"):
        oneshot(model=model, dataset=_calibration(), recipe=[SmoothQuantModifier(smoothing_strength=0.8),
                GPTQModifier(scheme="W8A8", ignore=["lm_head", "re:.*mlp.gate$"])])  # fmt: skip
    assert "Linears run inside opaque code (model.layers.0.mlp.experts.0.gate_proj" in caplog.text
    assert "SmoothQuantModifier: 3 mappings (model.layers.0.input_layernorm" in caplog.text
    assert not torch.equal(model.model.layers[1].input_layernorm.weight, norm)


class _Interrupted(Exception):
    pass


def test_an_interrupted_smoothquant_run_resumes_to_the_same_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import seqcal.checkpoint.streaming as streaming
    from save_helpers import checkpoint_tensors

    ARCHS["llama"].build().save_pretrained(tmp_path / "model")
    run = {"model": str(tmp_path / "model"), "dataset": _calibration(),
           "recipe": str(ROOT / "recipes" / "smoothquant_gptq_w8a8_static.yaml")}  # fmt: skip
    oneshot(output_dir=str(tmp_path / "clean"), **run)
    monkeypatch.setattr(streaming, "CHECKPOINT_BYTES", 1)  # progress recorded after every subgraph
    done, calls = streaming.StreamingCheckpoint.done, []

    def dies_after_five(self: streaming.StreamingCheckpoint, sg: object) -> None:
        done(self, sg)
        calls.append(sg)
        if len(calls) == 5:  # after the q/k/v and gate/up groups of layer 0 (norms folded) and more
            raise _Interrupted

    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", dies_after_five)
    with pytest.raises(_Interrupted):
        oneshot(output_dir=str(tmp_path / "killed"), **run)
    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", done)
    oneshot(output_dir=str(tmp_path / "killed"), resume=True, **run)
    a, b = checkpoint_tensors(tmp_path / "killed"), checkpoint_tensors(tmp_path / "clean")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_the_basic_pipeline_is_refused() -> None:
    model = ARCHS["llama"].build()
    with pytest.raises(ValueError, match="SmoothQuantModifier needs the sequential pipeline"):
        oneshot(model=model, dataset=_calibration(), pipeline="basic",
                recipe=[SmoothQuantModifier(mappings=LLMC), GPTQModifier(scheme="W8A8", ignore=["lm_head"])])  # fmt: skip
