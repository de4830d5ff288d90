"""oneshot from quantized checkpoints: DeepSeek-V3 in FP8 blocks, gpt-oss with MXFP4 experts, compressed-tensors.

A run from a quantized source reads each weight dequantized as its subgraph onloads it. It runs GPTQ to W4A16
and NVFP4 and its checkpoint reloads; its round-to-nearest W8A16 checkpoint is byte for byte the one the same
run writes from the bf16 checkpoint the source dequantizes to; the output's quantization_config and report
record the source's format.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from seqcal.entrypoint import oneshot
from seqcal.evaluation.loading import load_causal_lm
from seqcal.execution.store import load_offloaded
from seqcal.modifiers import GPTQModifier, QuantizationModifier
from sources_helpers import (
    checkpoint_bytes,
    save_deepseek,
    save_gpt_oss,
    save_llama,
    token_data,
    write_dequantized_copy,
    write_fp8_block,
    write_mxfp4,
)

W4A16 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
FP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
NVFP4 = {"weights": FP4, "input_activations": FP4 | {"dynamic": "local"}}


def gptq(source: str) -> GPTQModifier:
    routers = {"fp8-block": ["re:.*mlp.gate$"]}.get(source, [])  # DeepSeek's router is a Linear
    return GPTQModifier(config_groups=RECIPES[source], ignore=["lm_head", *routers])


# A run per source (the MoE ones in one scheme: transformers 5.24 reloads fused experts of one scheme only)
RECIPES = {
    "fp8-block": {"all": {"targets": ["Linear"], **NVFP4}},  # FP8 blocks -> NVFP4: no requantize needed
    "mxfp4": {"all": {"targets": ["Linear"], "weights": W4A16}},
    "NVFP4": {"attention": {"targets": ["re:.*self_attn.*"], "weights": W4A16},
              "mlp": {"targets": ["re:.*mlp.*"], **NVFP4}},
}  # fmt: skip


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each source format's tiny checkpoint (the compressed-tensors ones written by seqcal from a bf16 Llama)."""
    root = tmp_path_factory.mktemp("sources")
    out = {"fp8-block": write_fp8_block(save_deepseek(root / "deepseek"), root / "fp8-block"),
           "mxfp4": write_mxfp4(save_gpt_oss(root / "gpt-oss"), root / "mxfp4")}  # fmt: skip
    llama = save_llama(root / "llama")
    for scheme in ("W4A16", "W8A8", "FP8_DYNAMIC", "NVFP4"):
        data = {"pipeline": "datafree"} if scheme != "NVFP4" else {"dataset": token_data(2, 16)}
        oneshot(model=str(llama), output_dir=str(root / scheme), max_seq_length=16,
                recipe=QuantizationModifier(scheme=scheme, targets=["Linear"], ignore=["lm_head"]), **data)  # fmt: skip
        out[scheme] = root / scheme
    return out


@pytest.mark.parametrize("source, requantize", [("fp8-block", False), ("mxfp4", True), ("NVFP4", True)])
def test_gptq_from_a_quantized_source_runs_and_reloads(
    tmp_path: Path, sources: dict[str, Path], source: str, requantize: bool, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="seqcal"):
        oneshot(model=str(sources[source]), dataset=token_data(2, 16), recipe=gptq(source),
                output_dir=str(out), num_calibration_samples=2, max_seq_length=16, requantize=requantize)  # fmt: skip
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    assert block["quant_method"] == "compressed-tensors"
    assert block["source_format"]["format"] == {"NVFP4": "nvfp4"}.get(source, source)
    assert block["source_format"]["requantized"] is requantize
    report = json.loads((out / "quantization_report.json").read_text())
    assert report["source_format"] == block["source_format"]
    assert ("errors of the two roundings compound" in caplog.text) is requantize
    model = load_causal_lm(out, torch.float32)
    logits = model(torch.tensor([token_data(1, 8)[0]["input_ids"]])).logits
    assert logits.isfinite().all()


@pytest.mark.parametrize("source", ["fp8-block", "mxfp4", "W4A16", "W8A8", "FP8_DYNAMIC", "NVFP4"])
def test_w8a16_from_a_quantized_source_equals_the_run_on_its_dequantized_copy(
    tmp_path: Path, sources: dict[str, Path], source: str
) -> None:
    w8a16 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    routers = ["re:.*mlp.gate$"] if source == "fp8-block" else []
    groups = {"w8a16": {"targets": ["Linear"], "weights": w8a16}}
    recipe = QuantizationModifier(config_groups=groups, ignore=["lm_head", *routers])
    copy = write_dequantized_copy(sources[source], tmp_path / "bf16")
    for model, out in ((sources[source], tmp_path / "from-source"), (copy, tmp_path / "from-copy")):
        oneshot(model=str(model), recipe=recipe, output_dir=str(out), pipeline="datafree", requantize=True)
    assert checkpoint_bytes(tmp_path / "from-source") == checkpoint_bytes(tmp_path / "from-copy")
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("from-source", "from-copy")]
    assert configs[0]["quantization_config"].pop("source_format")["requantized"] is True
    assert configs[0] == configs[1]


@pytest.mark.parametrize("source", ["fp8-block", "mxfp4", "NVFP4"])
def test_offloaded_reads_equal_the_dequantized_copy(
    tmp_path: Path, sources: dict[str, Path], source: str
) -> None:
    """What each subgraph onloads from a quantized source (per expert for gpt-oss's fused MXFP4 experts)."""
    copy = write_dequantized_copy(sources[source], tmp_path / "bf16")
    (model, store), (_, reference) = load_offloaded(sources[source]), load_offloaded(copy)
    assert store.source is not None and reference.source is None
    names = [n for n, _ in model.named_parameters()]
    assert any(".experts.0." in n for n in names) or source == "NVFP4"
    for name in names:
        assert torch.equal(store.read(name), reference.read(name)), name
