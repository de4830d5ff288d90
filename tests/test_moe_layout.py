"""The MoE checkpoint layout vLLM's compressed-tensors loader reads (llm-compressor 0.14 writes the same), and
bad MoE recipes refused before calibration, through ``oneshot`` and the ``seqcal oneshot`` command.

``benchmarks/peers/moe_peer_layout.py`` compares seqcal's checkpoints with llm-compressor's tensor by tensor; these
tests pin the layout it found equal without needing llm-compressor.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from seqcal.entrypoint import oneshot
from test_moe import data, tiny_qwen3_moe
from zoo import ARCHS

W4A16 = "GPTQModifier: {scheme: W4A16, ignore: [lm_head, 're:.*mlp[.](gate|router)$']}"
W4G16 = """
GPTQModifier:
  ignore: [lm_head, 're:.*mlp[.](gate|router)$']
  config_groups:
    group_0:
      targets: [Linear]
      weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 16}
"""


def header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor of a checkpoint directory."""
    out = {}
    for file in path.glob("*.safetensors"):
        with open(file, "rb") as f:
            meta = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in meta.items() if k != "__metadata__"})
    return out


def packed_int4(prefix: str, out: int, inp: int, group: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """compressed-tensors' pack-quantized tensors of one symmetric int4 group-quantized Linear."""
    return {f"{prefix}.weight_packed": ("I32", (out, inp // 8)), f"{prefix}.weight_scale": ("F32", (out, inp // group)),
            f"{prefix}.weight_shape": ("I64", (2,))}  # fmt: skip


def test_qwen3_moe_checkpoint_layout(tmp_path: Path) -> None:
    """Per-expert tensors under the checkpoint's own names, int4 packed in int32, one scale per group of 128;
    the routers stay dense and are listed in the ignore list (vLLM builds them as Linear layers)."""
    oneshot(model=tiny_qwen3_moe(experts=4), dataset=data(2, 16), recipe=W4A16, output_dir=str(tmp_path))
    got = header(tmp_path)
    want: dict[str, tuple[str, tuple[int, ...]]] = {}
    for layer in range(2):
        p = f"model.layers.{layer}"
        for e in range(4):
            want |= packed_int4(f"{p}.mlp.experts.{e}.gate_proj", 128, 128, 128)
            want |= packed_int4(f"{p}.mlp.experts.{e}.up_proj", 128, 128, 128)
            want |= packed_int4(f"{p}.mlp.experts.{e}.down_proj", 128, 128, 128)
        want[f"{p}.mlp.gate.weight"] = ("F32", (4, 128))
    assert {k: v for k, v in got.items() if ".mlp." in k} == want
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["targets"] == [
        "Linear"
    ]
    assert sorted(config["ignore"]) == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]


def test_gpt_oss_checkpoint_layout(tmp_path: Path) -> None:
    """GPT-OSS keeps its experts fused and transposed, gate and up interleaved, with biases: the checkpoint
    holds them per expert, as Linear weights [out, in] with their biases dense beside them."""
    model = ARCHS["gpt_oss"].build()  # 3 layers, 4 experts, hidden 64, intermediate 32
    oneshot(model=model, dataset=data(2, 16), recipe=W4G16, output_dir=str(tmp_path))
    got = header(tmp_path)
    want: dict[str, tuple[str, tuple[int, ...]]] = {}
    for layer in range(3):
        p = f"model.layers.{layer}.mlp"
        for e in range(4):
            for leaf, out, inp in (("gate_proj", 32, 64), ("up_proj", 32, 64), ("down_proj", 64, 32)):
                want |= packed_int4(f"{p}.experts.{e}.{leaf}", out, inp, 16)
                want[f"{p}.experts.{e}.{leaf}.bias"] = ("F32", (out,))
        want |= {f"{p}.router.weight": ("F32", (4, 64)), f"{p}.router.bias": ("F32", (4,))}
    assert {k: v for k, v in got.items() if ".mlp." in k} == want
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert sorted(config["ignore"]) == ["lm_head"] + [f"model.layers.{i}.mlp.router" for i in range(3)]


BAD = {
    # a target that names expert modules this model does not have (a typo of down_proj)
    "missing": ("GPTQModifier: {scheme: W8A16, targets: ['re:.*experts.*donw_proj']}",
                r"'re:\.\*experts\.\*donw_proj' matches no module of Qwen3MoeForCausalLM"),
    # groups of 128 do not divide the experts' 96 intermediate features (down_proj's inputs)
    "shape": ("GPTQModifier: {scheme: W4A16, ignore: [lm_head]}",
              r"group_size 128 .*model\.layers\.0\.mlp\.experts\.0\.down_proj \(96 inputs\)"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_moe_recipe_fails_before_calibration(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import seqcal.entrypoint

    def calibrate(*args: object, **kwargs: object) -> None:
        raise AssertionError("calibration started")

    monkeypatch.setattr(seqcal.entrypoint, "run_pipeline", calibrate)
    recipe, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        oneshot(model=tiny_qwen3_moe(experts=4, intermediate=96), dataset=data(1, 8), recipe=recipe)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_moe_recipe_on_the_command_line(case: str, tmp_path: Path) -> None:
    """One line on stderr (what, where, the fix), no traceback, exit code 2, nothing written."""
    tiny_qwen3_moe(experts=4, intermediate=96).save_pretrained(tmp_path / "src")
    (tmp_path / "data.jsonl").write_text(json.dumps(data(1, 8)[0]))
    recipe, message = BAD[case]
    run = subprocess.run(
        [sys.executable, "-m", "seqcal.cli", "oneshot", "--model", str(tmp_path / "src"), "--dataset",
         str(tmp_path / "data.jsonl"), "--recipe", recipe, "--output-dir", str(tmp_path / "out"), "--plot", "none"],
        capture_output=True, text=True, env=os.environ, timeout=300,
    )  # fmt: skip
    errors = [line for line in run.stderr.splitlines() if line.startswith("seqcal: error:")]
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and len(errors) == 1, run.stderr
    assert re.search(message, errors[0]), errors[0]
    assert "calibrating" not in run.stderr and not (tmp_path / "out" / "model.safetensors").exists()
