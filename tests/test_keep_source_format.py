"""keep_source_format: an FP8 checkpoint's Linears the recipe leaves alone are written in their stored FP8 form.

A tiny DeepSeek-V3 in FP8 blocks (as DeepSeek ships it) calibrated with GPTQ on its MLP only: the attention's
float8 weights and float32 block scales reach the output byte for byte, beside the MLP's int4, in one config
whose groups describe both; transformers reloads it with the run's model's logits; one process and two, and a
run stopped and resumed, give the same bytes. A per-tensor FP8 Llama through the data-free pipeline; what
cannot keep its form is refused in one sentence before calibration.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dist_helpers import run, stopped_after, tensor_hashes
from save_helpers import checkpoint_tensors
from seqcal.entrypoint import oneshot
from seqcal.evaluation.loading import load_causal_lm
from seqcal.modifiers import GPTQModifier, KeepSourceFormatModifier, QuantizationModifier
from sources_helpers import (
    save_deepseek,
    save_gpt_oss,
    save_llama,
    token_data,
    write_fp8_block,
    write_fp8_per_tensor,
    write_mxfp4,
)

W4A16 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
MLP_ONLY = {"mlp": {"targets": ["re:.*mlp\\.(experts|shared_experts|gate_proj|up_proj|down_proj).*"],
                    "weights": W4A16}}  # fmt: skip


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("keep")
    return write_fp8_block(save_deepseek(root / "bf16"), root / "fp8-block")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Every run here with one thread, as each process of the two-process run has: the same bytes for any number
    of processes need the same threads per process (docs/design.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _args(source: Path, out: Path, **extra: object) -> dict:
    recipe = GPTQModifier(config_groups=MLP_ONLY, ignore=["lm_head", "re:.*mlp.gate$"])
    return {"model": str(source), "dataset": token_data(4, 16), "recipe": recipe, "max_seq_length": 16,
            "output_dir": str(out), "keep_source_format": True, **extra}  # fmt: skip


@pytest.fixture(scope="module")
def kept(deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    out = tmp_path_factory.mktemp("runs") / "kept"
    return out, oneshot(**_args(deepseek, out))


def test_untargeted_fp8_weights_keep_their_bytes(deepseek: Path, kept: tuple[Path, torch.nn.Module]) -> None:
    out, _ = kept
    source, written = checkpoint_tensors(deepseek), checkpoint_tensors(out)
    attention = [k for k in source if ".self_attn." in k and k.endswith(".weight_scale_inv")]
    assert len(attention) == 10  # q_a, q_b, kv_a_with_mqa, kv_b and o_proj of 2 layers
    for scale_key in attention:
        weight_key = scale_key.removesuffix("_scale_inv")
        assert written[weight_key].dtype == torch.float8_e4m3fn
        as_bytes = written[weight_key].view(torch.uint8), source[weight_key].view(torch.uint8)
        assert torch.equal(*as_bytes), weight_key
        assert torch.equal(written[scale_key.removesuffix("_inv")], source[scale_key]), scale_key
    assert any(k.endswith("mlp.down_proj.weight_packed") for k in written)  # the recipe's int4 beside them
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    assert block["format"] == "mixed-precision"
    formats = sorted(g["format"] for g in block["config_groups"].values())
    assert formats == ["float-quantized", "pack-quantized"]
    fp8 = next(g for g in block["config_groups"].values() if g["format"] == "float-quantized")
    assert fp8["weights"]["strategy"] == "block" and fp8["weights"]["block_structure"] == [128, 128]
    assert fp8["input_activations"]["dynamic"] is True
    assert block["source_format"]["format"] == "fp8-block"


@pytest.fixture(scope="module")
def plain(deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run without the option: the attention written dequantized, in bfloat16."""
    out = tmp_path_factory.mktemp("runs") / "plain"
    oneshot(**_args(deepseek, out, keep_source_format=False))
    return out


def test_without_the_option_the_attention_is_dequantized(plain: Path) -> None:
    written = checkpoint_tensors(plain)
    assert written["model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert not any(k.endswith("weight_scale") and ".self_attn." in k for k in written)


def _block_dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return q.float() * full


def test_the_output_reloads_in_transformers(kept: tuple[Path, torch.nn.Module], plain: Path) -> None:
    """transformers loads the kept Linears compressed (FP8 codes, their scales cast to the model's dtype) and every
    other weight as the run without the option wrote it; the kept weights are the source's values up to that
    cast of their scales (float32 in the file, as vLLM reads them), and the forward runs."""
    kept_model, plain_model = load_causal_lm(kept[0], torch.bfloat16), load_causal_lm(plain, torch.bfloat16)
    weights = dict(plain_model.named_parameters())
    kept_modules = 0
    for name, module in kept_model.named_modules():
        if getattr(module, "weight", None) is not None and module.weight.dtype == torch.float8_e4m3fn:
            kept_modules += 1
            value = _block_dequantized(module.weight, module.weight_scale)
            reference = weights[f"{name}.weight"].float()
            # two bfloat16 roundings apart at most (the scale's on load, the plain weight's): 2^-9 each
            assert ((value - reference).abs() <= reference.abs() * 2**-7 + 1e-30).all(), name
    assert kept_modules == 10
    for name, param in kept_model.named_parameters():
        if param.dtype == torch.bfloat16 and not name.endswith("weight_scale") and name in weights:
            assert torch.equal(param, weights[name]), name
    with torch.no_grad():
        assert kept_model(torch.tensor([token_data(1, 12)[0]["input_ids"]])).logits.isfinite().all()


def test_same_bytes_with_two_processes_and_after_a_resume(
    deepseek: Path, kept: tuple[Path, torch.nn.Module], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = kept[0]
    run(2, tmp_path / "err", **_args(deepseek, tmp_path / "two"))
    stopped = tmp_path / "stopped"
    stopped_after(monkeypatch, 1, **_args(deepseek, stopped))
    oneshot(**_args(deepseek, stopped, resume=True))
    for out in (tmp_path / "two", stopped):
        assert tensor_hashes(out) == tensor_hashes(reference), out
        assert (out / "config.json").read_bytes() == (reference / "config.json").read_bytes(), out


def test_per_tensor_fp8_through_the_data_free_pipeline(tmp_path: Path) -> None:
    source = write_fp8_per_tensor(save_llama(tmp_path / "llama"), tmp_path / "fp8")
    recipe = QuantizationModifier(config_groups={"mlp": {"targets": ["re:.*mlp.*"], "weights": W4A16}},
                                  ignore=["lm_head"])  # fmt: skip
    oneshot(model=str(source), recipe=recipe, pipeline="datafree", output_dir=str(tmp_path / "out"),
            keep_source_format=True)  # fmt: skip
    stored, written = checkpoint_tensors(source), checkpoint_tensors(tmp_path / "out")
    key = "model.layers.0.self_attn.q_proj"
    assert torch.equal(written[f"{key}.weight"].view(torch.uint8), stored[f"{key}.weight"].view(torch.uint8))
    assert torch.equal(written[f"{key}.weight_scale"], stored[f"{key}.weight_scale_inv"])
    block = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    fp8 = next(g for g in block["config_groups"].values() if g["format"] == "float-quantized")
    assert fp8["weights"]["strategy"] == "tensor"
    logits = load_causal_lm(tmp_path / "out", torch.bfloat16)(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.isfinite().all()


def test_what_cannot_keep_its_form_is_refused(deepseek: Path, tmp_path: Path) -> None:
    mxfp4 = write_mxfp4(save_gpt_oss(tmp_path / "gpt-oss"), tmp_path / "mxfp4")
    recipe = GPTQModifier(config_groups={"a": {"targets": ["re:.*self_attn.*"], "weights": W4A16}},
                          ignore=["lm_head"])  # fmt: skip
    with pytest.raises(ValueError, match="only FP8 sources"):
        oneshot(model=str(mxfp4), recipe=recipe, dataset=token_data(2, 16), output_dir=str(tmp_path / "a"),
                keep_source_format=True, requantize=True)  # fmt: skip
    with pytest.raises(ValueError, match="holds full-precision weights"):
        oneshot(model=str(tmp_path / "gpt-oss"), recipe=recipe, dataset=token_data(2, 16),
                output_dir=str(tmp_path / "b"), keep_source_format=True)  # fmt: skip
    with pytest.raises(ValueError, match="must be the recipe's last modifier"):
        oneshot(model=str(deepseek), recipe=[KeepSourceFormatModifier(), recipe], dataset=token_data(2, 16),
                output_dir=str(tmp_path / "c"))  # fmt: skip
    assert not any((tmp_path / d).exists() and any((tmp_path / d).iterdir()) for d in "abc")
