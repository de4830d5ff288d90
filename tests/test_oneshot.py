"""oneshot end to end: recipes -> calibration -> checkpoint that transformers reloads to the same model."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationScheme
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, LlamaConfig, LlamaForCausalLM

from save_helpers import as_bfloat16, checkpoint_tensors
from seqcal.checkpoint.config import runs_only_in_bfloat16
from seqcal.entrypoint import oneshot
from seqcal.evaluation.loading import apply_online_transforms
from seqcal.modifiers import GPTQModifier, QuantizationModifier
from seqcal.modifiers.activations import quantized_inputs
from seqcal.modifiers.base import QuantizedWeight, RunState
from seqcal.modifiers.state import RunResults
from seqcal.recipe.parse import parse_recipe

RECIPES = [p for p in sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))]
VOCAB = 256


def tiny_llama(seed: int = 0, kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=128,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def token_data(n: int = 16, length: int = 32) -> list[dict[str, list[int]]]:
    """Correlated token streams (a random walk over the vocabulary), so activations have structure."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        steps = torch.randint(-3, 4, (length,), generator=g)
        rows.append({"input_ids": (steps.cumsum(0) % VOCAB).tolist()})
    return rows


def probe() -> dict[str, torch.Tensor]:
    ids = torch.tensor([row["input_ids"] for row in token_data(3, 24)])
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return {"input_ids": ids, "attention_mask": mask}


def runtime_activations(model: torch.nn.Module, out: Path, block: dict) -> contextlib.AbstractContextManager:
    """Input fake-quant of the quantized Linears as the loaded checkpoint runs them: per token (dynamic) or
    with the checkpoint's calibrated input_scale / input_zero_point (static)."""
    group = block.get("config_groups", {}).get("group_0", {})  # none for a pruned, unquantized model
    if not group.get("input_activations"):
        return contextlib.nullcontext()
    scheme = QuantizationScheme.model_validate(group)
    tensors = checkpoint_tensors(out)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    empty = torch.empty(0)
    state = RunState(results=RunResults(quantized={
        n: QuantizedWeight(empty, empty, None, None, scheme, input_scale=tensors.get(f"{n}.input_scale"),
                           input_zero_point=tensors.get(f"{n}.input_zero_point"),
                           input_global_scale=tensors.get(f"{n}.input_global_scale"))
        for n in names
    }))  # fmt: skip
    return quantized_inputs(model, state, dict.fromkeys(names, scheme))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_shipped_recipe_round_trips(recipe: Path, tmp_path: Path) -> None:
    # FP8_BLOCK: k_proj's rows must be a multiple of the 128-row block that vLLM merges with q_proj's
    model = tiny_llama(kv_heads=4 if "fp8_block" in recipe.stem else 2)
    out = tmp_path / "ckpt"
    oneshot(model=model, dataset=token_data(), recipe=str(recipe), output_dir=str(out), max_seq_length=32)
    assert (out / "recipe.yaml").is_file() and (out / "quantization_report.json").is_file()
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert "lm_head" in config.get("ignore", []) or not state_quantizes(recipe)
    asym = config.get("dequantize", False)  # packed asymmetric zero points (the config asks for it)
    # Asymmetric packed zero points need dequantize=True in transformers 5.24 (upstream bug, see test_save).
    extra = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if asym else {}
    if runs_only_in_bfloat16(config):  # NVFP4 W4A4: compressed-tensors runs fp4 activations in bf16 only
        extra["dtype"] = torch.bfloat16
    loaded = AutoModelForCausalLM.from_pretrained(out, **extra).eval()
    if "transform_config" in config:  # QuIP: transformers 5.24 leaves the online rotations to the loader
        apply_online_transforms(loaded, config, out)
    inputs = probe()
    if "fp8_block" in recipe.stem:  # dynamic fp8 activations in groups of 128, compressed-tensors' own
        names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
        handles = [model.get_submodule(n).register_forward_pre_hook(_fp8_groups) for n in names]
        try:
            with torch.no_grad():
                want = model(**inputs).logits
        finally:
            for handle in handles:
                handle.remove()
    else:
        # fp4 activations (NVFP4 W4A4) round differently in another dtype: compare in the dtype loaded
        model = as_bfloat16(model) if "dtype" in extra else model
        with torch.no_grad(), runtime_activations(model, out, config):
            want = model(**inputs).logits.float()
    with torch.no_grad():
        got = loaded(**inputs).logits.float()
    if "dtype" in extra:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    elif (
        "nvfp4" in recipe.stem
    ):  # compressed-tensors decompresses NVFP4 to bfloat16: weights to bf16 precision
        torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def state_quantizes(recipe: Path) -> bool:
    """Whether a shipped recipe quantizes (a pruning-only recipe writes no quantization groups)."""
    return any(hasattr(m, "modules") for m in parse_recipe(str(recipe)).modifiers)


def _fp8_groups(module: torch.nn.Module, args: tuple) -> tuple[torch.Tensor]:
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    acts = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).input_activations
    scale, _ = compute_dynamic_scales_and_zp(args[0], acts, module=module)
    return (fake_quantize(args[0], scale, None, acts),)


def _output_error(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    inputs = probe()
    with torch.no_grad():
        a, b = model(**inputs).logits, reference(**inputs).logits
    return ((a - b).norm() / b.norm()).item()


def test_gptq_beats_rtn_on_real_activations() -> None:
    scheme = {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "strategy": "group", "group_size": 32}}}  # fmt: skip
    reference = tiny_llama()
    gptq, rtn = tiny_llama(), tiny_llama()
    data = token_data(32, 48)
    oneshot(model=gptq, dataset=data, recipe=GPTQModifier(config_groups=scheme, ignore=["lm_head"]))
    oneshot(model=rtn, dataset=data, recipe=QuantizationModifier(config_groups=scheme, ignore=["lm_head"]))
    assert _output_error(gptq, reference) < 0.8 * _output_error(rtn, reference)


def test_no_hooks_left_and_sdpa_kept(tmp_path: Path) -> None:
    model = tiny_llama()
    hooks = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())  # noqa: E731
    before = hooks()
    oneshot(model=model, dataset=token_data(4), recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]))
    assert hooks() == before
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("one_pass, cuts", [(True, 8), (False, 2)])
def test_report_has_per_layer_errors(tmp_path: Path, one_pass: bool, cuts: int) -> None:
    out = tmp_path / "out"
    oneshot(model=tiny_llama(), dataset=token_data(8), recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
            output_dir=str(out), one_pass=one_pass)  # fmt: skip
    report = json.loads((out / "quantization_report.json").read_text())
    # one pass: a subgraph per group of modules reading one input (qkv, o, gate/up, down); else per layer
    layers = [row for row in report["subgraphs"] if row["targets"]]
    assert len(layers) == cuts and all(0 < row["rel_error"] < 1 for row in layers)
    losses = [m["gptq_loss"] for m in report["modules"].values()]
    assert len(losses) == 14 and all(loss > 0 for loss in losses)
    if one_pass:
        assert all(0 < m["rel_error"] < 1 for m in report["modules"].values())


def test_pipelines_agree_on_rtn() -> None:
    recipe = QuantizationModifier(scheme="W4A16", ignore=["lm_head"])
    a, b, c = tiny_llama(), tiny_llama(), tiny_llama()
    oneshot(model=a, dataset=token_data(4), recipe=recipe)
    oneshot(model=b, recipe=QuantizationModifier(scheme="W4A16", ignore=["lm_head"]), pipeline="datafree")
    oneshot(model=c, dataset=token_data(4), recipe=QuantizationModifier(scheme="W4A16", ignore=["lm_head"]),
            pipeline="basic")  # fmt: skip
    for x, y in [(a, b), (a, c)]:
        for (n, p), (_, q) in zip(x.named_parameters(), y.named_parameters()):
            assert torch.equal(p, q), n


def test_basic_pipeline_gptq_equals_sequential_on_first_layer() -> None:
    seq, one, basic = tiny_llama(), tiny_llama(), tiny_llama()
    recipe = lambda: GPTQModifier(scheme="W4A16", ignore=["lm_head"])  # noqa: E731
    oneshot(model=seq, dataset=token_data(8), recipe=recipe(), one_pass=False)
    oneshot(model=one, dataset=token_data(8), recipe=recipe())
    oneshot(model=basic, dataset=token_data(8), recipe=recipe(), pipeline="basic")
    # Layer 0 sees the same (unquantized) inputs in the layer-cut and basic pipelines, so its GPTQ result
    # is the same. Cut before each module, q/k/v still do, but o_proj is calibrated on the attention
    # output of the already quantized q/k/v.
    weight = lambda model, name: model.get_submodule(f"model.layers.0.self_attn.{name}").weight  # noqa: E731
    for name in ["q_proj", "k_proj", "v_proj", "o_proj"]:
        torch.testing.assert_close(weight(seq, name), weight(basic, name), atol=1e-6, rtol=0)
    for name in ["q_proj", "k_proj", "v_proj"]:
        torch.testing.assert_close(weight(one, name), weight(basic, name), atol=1e-6, rtol=0)
    assert not torch.equal(weight(one, "o_proj"), weight(basic, "o_proj"))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"recipe": "GPTQModifier: {scheme: W4A16}", "dataset": [], "bogus_arg": 1}, TypeError, "bogus_arg"),
        ({"recipe": "GPTQModifier: {scheme: W4A16}", "num_calibraton_samples": 4}, TypeError, "did you mean"),
        ({"recipe": "GPTQModifier: {scheme: W4A16}", "pipeline": "fast"}, ValueError, "pipeline"),
        ({"recipe": "GPTQModifier: {scheme: W4A16}", "dtype": "int3"}, ValueError, "dtype"),
        ({"recipe": "GPTQModifier: {scheme: W4A16}", "offload": "gpu"}, ValueError, "offload"),
        ({"recipe": "GPTQModifier: {scheme: W4A16}", "pipeline": "datafree"}, ValueError, "datafree"),
        ({"recipe": "GPTQModifier: {scheme: W4A16, targets: Conv9d}"}, ValueError, "Conv9d. matches no"),
        ({"recipe": "GPTQModifier: {scheme: W4A16, actorder: group}"}, ValueError, "weight"),
        ({"recipe": "GPTQModifier: {scheme: W9A99}"}, ValueError, "unknown scheme"),
        (
            {"recipe": "GPTQModifier: {scheme: W4A16}", "dataset": "/no/such/file.txt"},
            FileNotFoundError,
            "file",
        ),
        (
            {"recipe": "GPTQModifier: {scheme: W4A16}", "num_calibration_samples": 0},
            ValueError,
            "num_calibration",
        ),
    ],
)
def test_bad_arguments_are_explained(kwargs: dict, error: type, match: str) -> None:
    kwargs = {"dataset": token_data(2), **kwargs}
    with pytest.raises(error, match=match):
        oneshot(model=tiny_llama(), **kwargs)


def test_bad_model_and_output_dir(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="model must be"):
        oneshot(model=42, recipe="GPTQModifier: {scheme: W4A16}")
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite"):
        oneshot(model=tiny_llama(), dataset=token_data(2), recipe="QuantizationModifier: {scheme: W4A16}",
                output_dir=str(tmp_path))  # fmt: skip
    assert (tmp_path / "x").read_text() == "keep me"
    with pytest.raises(ValueError, match="neither an alias nor an existing directory"):
        oneshot(model="no-such-model-dir", recipe="QuantizationModifier: {scheme: W4A16}")


def test_autocast_compute_dtype_keeps_fp32_weights_and_quality() -> None:
    scheme = {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "strategy": "group", "group_size": 32}}}  # fmt: skip
    reference, fast, exact = tiny_llama(), tiny_llama(), tiny_llama()
    data = token_data(16, 48)
    oneshot(model=fast, dataset=data, recipe=GPTQModifier(config_groups=scheme, ignore=["lm_head"]),
            compute_dtype="bfloat16")  # fmt: skip
    oneshot(model=exact, dataset=data, recipe=GPTQModifier(config_groups=scheme, ignore=["lm_head"]))
    assert fast.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    # bf16 matmuls in the forward passes change the Hessians only slightly: the error stays within 10%
    assert _output_error(fast, reference) < 1.1 * _output_error(exact, reference)


def test_a_group_size_that_does_not_divide_the_inputs_fails_before_calibrating() -> None:
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )  # fmt: skip
    ).eval()
    with pytest.raises(
        ValueError, match=r"group_size 128 does not divide the inputs of 14 module\(s\): model\.layers"
    ):
        oneshot(
            model=model, dataset=token_data(2, 16), recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"])
        )


def test_concatenate_reaches_the_data_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    import seqcal.entrypoint
    from seqcal.cli import build_parser

    seen = []

    def stop(model, tokenizer, modifiers, data_args, *args, **kwargs):
        seen.append(data_args)
        raise RuntimeError("stop here")

    monkeypatch.setattr(seqcal.entrypoint, "run_pipeline", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        oneshot(model=tiny_llama(), dataset=token_data(2, 16), recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
                concatenate=True, max_seq_length=16)  # fmt: skip
    assert seen[0].concatenate is True
    args = build_parser().parse_args(["oneshot", "--model", "m", "--recipe", "r", "--concatenate"])
    assert args.concatenate is True
