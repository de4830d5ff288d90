"""GPTAQModifier: GPTQ fitted to the full-precision model's outputs, in every cut, process count and resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_helpers import data, run, stopped_after, tensor_hashes
from save_helpers import save_llama, tiny_llama
from seqcal.entrypoint import oneshot
from seqcal.modifiers import GPTAQModifier, GPTQModifier

GROUPS = {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                   "strategy": "group", "group_size": 32}}}  # fmt: skip
RECIPE = "GPTAQModifier: {ignore: [lm_head], config_groups: " + str(GROUPS).replace("'", "") + "}"


@pytest.mark.parametrize("one_pass", [True, False])
def test_gptaq_leaves_less_output_error_than_gptq(one_pass: bool) -> None:
    rows = [{"input_ids": [(i * 7 + j * 3) % 128 for j in range(24)]} for i in range(8)]
    x = torch.tensor([r["input_ids"] for r in rows])
    with torch.no_grad():
        want = tiny_llama()(input_ids=x).logits
    errors = {}
    for cls in (GPTQModifier, GPTAQModifier):
        model = tiny_llama()
        oneshot(model=model, dataset=rows, recipe=cls(config_groups=GROUPS, ignore=["lm_head"]), one_pass=one_pass,
                max_seq_length=24)  # fmt: skip
        with torch.no_grad():
            errors[cls.name] = ((model(input_ids=x).logits - want).norm() / want.norm()).item()
    assert errors["GPTAQModifier"] < errors["GPTQModifier"], errors


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama"), 2)


def _args(model: Path, out: Path) -> dict:
    return {"model": str(model), "dataset": data(5, 24), "recipe": RECIPE, "max_seq_length": 24,
            "output_dir": str(out)}  # fmt: skip


def test_gptaq_gives_the_same_bytes_for_1_and_2_processes(model_dir: Path, tmp_path: Path) -> None:
    run(1, tmp_path / "e1", **_args(model_dir, tmp_path / "w1"))
    run(2, tmp_path / "e2", **_args(model_dir, tmp_path / "w2"))
    one = tensor_hashes(tmp_path / "w1")
    assert len(one) > 10 and one == tensor_hashes(tmp_path / "w2")


@pytest.mark.parametrize("one_pass", [True, False])
def test_gptaq_resumes_to_the_same_bytes(
    one_pass: bool, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    oneshot(**_args(model_dir, tmp_path / "clean"), one_pass=one_pass)
    out = tmp_path / "stopped"
    stopped_after(monkeypatch, 2, **_args(model_dir, out), one_pass=one_pass)
    oneshot(**_args(model_dir, out), one_pass=one_pass, resume=True)
    assert tensor_hashes(out) == tensor_hashes(tmp_path / "clean")


def test_gptaq_refuses_what_it_cannot_solve() -> None:
    with pytest.raises(ValueError, match="alpha must be a number"):
        GPTAQModifier(scheme="W4A16", alpha="big")
    with pytest.raises(ValueError, match="cannot run in one recipe"):
        oneshot(model=tiny_llama(), dataset=data(2, 16),
                recipe="SmoothQuantModifier: {}\nGPTAQModifier: {scheme: W8A8, ignore: [lm_head]}")  # fmt: skip
