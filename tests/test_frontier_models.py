"""The architectures behind the frontier checkpoints, each calibrated from its FP8 release and reloaded.

DeepSeek-V3 (MLA, shared experts, its multi-token-prediction layer), Kimi-K2 (DeepSeek-V3's classes, one expert
group), Qwen3-Next and Qwen3.5 (linear attention beside full attention, shared expert gate), GLM-4.5 (glm4_moe) and
MiniMax-M2 (``block_sparse_moe``), tiny, saved in FP8 blocks as their releases ship. GPTQ to W4A16 and to NVFP4 runs
from each (two runs: transformers 5.24 reloads fused experts of one scheme only), and each output reloads with the
architecture's own class. gpt-oss from its MXFP4 release: tests/test_sources_oneshot.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from frontier_helpers import ARCHITECTURES, add_mtp_layer, save_bf16, write_fp8_release
from seqcal.entrypoint import oneshot
from seqcal.modifiers import GPTQModifier, QuantizationModifier
from seqcal.sources import QuantizedCheckpoint
from sources_helpers import token_data

W4A16 = {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}}
FP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
NVFP4 = {"weights": FP4, "input_activations": FP4 | {"dynamic": "local"}}
# the routers stay in full precision, as in the releases
ROUTERS = {"minimax_m2": [r"re:.*block_sparse_moe\.gate$"], "qwen3_next": [r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$"],
           "qwen3_5_moe": [r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$"]}  # fmt: skip


def gptq(arch: str, scheme: dict) -> GPTQModifier:
    ignore = ["lm_head", *ROUTERS.get(arch, [r"re:.*mlp\.gate$"])]
    if arch == "deepseek_v3":  # an FP8 Linear the recipe leaves out (test_untargeted_...)
        ignore.append(r"re:.*kv_b_proj$")
    return GPTQModifier(config_groups={"all": {"targets": ["Linear"], **scheme}}, ignore=ignore)


def calibration_rows(path: Path) -> list[dict[str, list[int]]]:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return [{"input_ids": [t % vocab for t in row["input_ids"]]} for row in token_data(2, 16)]


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each architecture's FP8 release (DeepSeek-V3's with its MTP layer)."""
    root = tmp_path_factory.mktemp("releases")
    out = {}
    for arch in ARCHITECTURES:
        bf16 = save_bf16(arch, root / f"{arch}-bf16")
        out[arch] = write_fp8_release(add_mtp_layer(bf16) if arch == "deepseek_v3" else bf16, root / arch)
    return out


@pytest.fixture(scope="module")
def outputs(
    releases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    """The GPTQ run of an architecture's release to a scheme, made once (the MTP test reads DeepSeek-V3's)."""
    done: dict[tuple[str, str], Path] = {}

    def run(arch: str, scheme: str) -> Path:
        if (arch, scheme) not in done:
            out = tmp_path_factory.mktemp(f"{arch}-{scheme}")
            oneshot(model=str(releases[arch]), dataset=calibration_rows(releases[arch]), max_seq_length=16,
                    recipe=gptq(arch, W4A16 if scheme == "W4A16" else NVFP4), output_dir=str(out), overwrite=True)  # fmt: skip
            done[arch, scheme] = out
        return done[arch, scheme]

    return run


def stored_keys(path: Path) -> dict[str, str]:
    """Tensor name -> dtype, over a checkpoint's safetensors files."""
    keys = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys.update({k: str(f.get_slice(k).get_dtype()) for k in f.keys()})
    return keys


@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_gptq_from_the_fp8_release_reloads_with_its_class(
    releases: dict[str, Path], outputs: Callable[[str, str], Path], arch: str, scheme: str
) -> None:
    source, out = releases[arch], outputs(arch, scheme)
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    assert block["source_format"]["format"] == "fp8-block" and block["source_format"]["requantized"] is False
    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    experts = [
        k for k in stored_keys(out) if ".experts." in k and f".layers.{layers}." not in k
    ]  # MTP: below
    assert experts and not [k for k in experts if k.endswith(".weight")]  # every expert quantized
    model_class = getattr(transformers, ARCHITECTURES[arch][0])
    model = model_class.from_pretrained(out, dtype=torch.bfloat16).eval()  # NVFP4 runs in bfloat16 only
    assert type(model) is model_class
    logits = model(torch.tensor([calibration_rows(source)[0]["input_ids"][:8]])).logits
    assert logits.isfinite().all()


def test_deepseek_mtp_layer_is_kept_as_the_source_has_it(
    releases: dict[str, Path], outputs: Callable[[str, str], Path]
) -> None:
    """``model.layers.<num_hidden_layers>.*`` is no part of transformers' class; the output keeps it, dequantized,
    unquantized by the recipe and named in ``ignore`` (transformers 5.24's MTP drafter reads the layer with the main
    model's weight conversions, which for a compressed-tensors model expect its experts packed: it loads the MTP
    layer of seqcal's output only where the main model is unquantized)."""
    source, out = releases["deepseek_v3"], outputs("deepseek_v3", "W4A16")
    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    mtp = f"model.layers.{layers}."
    ckpt = QuantizedCheckpoint.open(source)
    want = sorted(n for n in ckpt.names() if n.startswith(mtp))
    assert len(want) > 10 and f"{mtp}eh_proj.weight" in want and ckpt.is_quantized(f"{mtp}eh_proj.weight")
    kept = {k: v for k, v in stored_keys(out).items() if k.startswith(mtp)}
    assert sorted(kept) == want  # every tensor, under its own name, none quantized again
    with safe_open(str(next(f for f in out.glob("*.safetensors") if f"{mtp}eh_proj.weight" in safe_open(str(f), "pt").keys())), "pt") as f:  # fmt: skip
        assert torch.equal(
            f.get_tensor(f"{mtp}eh_proj.weight"), ckpt.read(f"{mtp}eh_proj.weight", torch.bfloat16)
        )
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert f"{mtp}eh_proj" in ignore and f"{mtp}self_attn.q_a_proj" in ignore


def test_untargeted_fp8_weights_keep_the_dequantized_values_in_the_runs_dtype(
    releases: dict[str, Path], outputs: Callable[[str, str], Path]
) -> None:
    source, out = releases["deepseek_v3"], outputs("deepseek_v3", "W4A16")
    ckpt = QuantizedCheckpoint.open(source)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert ckpt.is_quantized(name)
    with safe_open(str(next(f for f in out.glob("*.safetensors") if name in safe_open(str(f), "pt").keys())), "pt") as f:  # fmt: skip
        kept = f.get_tensor(name)
    assert kept.dtype == torch.bfloat16 and torch.equal(kept, ckpt.read(name, torch.bfloat16))


def test_a_datafree_run_keeps_the_mtp_layer_too(tmp_path: Path, releases: dict[str, Path]) -> None:
    """Round to nearest writes the whole checkpoint at the end (no streaming): the MTP layer is kept there too."""
    w8a16 = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}
    recipe = QuantizationModifier(config_groups={"w8a16": {"targets": ["Linear"], **w8a16}}, ignore=["lm_head", r"re:.*mlp\.gate$"])  # fmt: skip
    oneshot(
        model=str(releases["deepseek_v3"]),
        recipe=recipe,
        output_dir=str(tmp_path),
        pipeline="datafree",
        requantize=True,
    )
    mtp = [
        n
        for n in QuantizedCheckpoint.open(releases["deepseek_v3"]).names()
        if n.startswith("model.layers.2.")
    ]
    assert mtp and set(mtp) <= set(stored_keys(tmp_path))
    assert (
        "model.layers.2.eh_proj"
        in json.loads((tmp_path / "config.json").read_text())["quantization_config"]["ignore"]
    )
