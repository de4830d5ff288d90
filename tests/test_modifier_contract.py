"""The modifier contract: declarations, statistics the framework owns, modifiers named by import path.

A modifier written outside the package (examples/importance_clip.py) declares one statistic and writes no
distributed or resume code: it must give the same bytes with one process and two, and after a resume; a
subclass that gathers data its parent's reduction does not know is refused with several processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dist_helpers import data, env_for_cli, run, start, stopped_after, tensor_hashes, wait_all
from save_helpers import save_llama
from seqcal.distributed.run import ShardedRun
from seqcal.entrypoint import oneshot
from seqcal.modifiers import Gather, GPTQModifier, QuantizationModifier, contract
from seqcal.modifiers.contract import ModifierSet
from seqcal.modifiers.needs import gathers_unshared
from seqcal.recipe import parse_recipe
from seqcal.recipe.parse import RecipeError

EXAMPLES = Path(__file__).parent.parent / "examples"
RECIPE = EXAMPLES / "importance_clip.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama"), 2)


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # forked ranks inherit it


def _args(model: Path, out: Path) -> dict:
    return {"model": str(model), "dataset": data(5, 24), "recipe": str(RECIPE), "max_seq_length": 24,
            "output_dir": str(out)}  # fmt: skip


@dataclass
class _ObservesBelowItsParent(QuantizationModifier):
    """The pitfall: hooks of its own under QuantizationModifier's reduction, which knows nothing of them."""

    def observe(self, names: list[str], x: torch.Tensor, state: object, batch: object) -> None:
        self._seen = getattr(self, "_seen", 0) + x.shape[0]


def test_declarations_are_read_once_and_the_pitfall_is_not_shared() -> None:
    from importance_clip import ImportanceClipModifier

    mods = ModifierSet.of([GPTQModifier(scheme="W4A16"), ImportanceClipModifier(scheme="W4A16")])
    assert mods.input_only and mods.calibrating and not mods.unshared()
    assert gathers_unshared(_ObservesBelowItsParent) and not gathers_unshared(GPTQModifier)
    assert ModifierSet.of([_ObservesBelowItsParent(scheme="W4A16")]).unshared() == ["_ObservesBelowItsParent"]


def test_the_pitfall_is_refused_with_two_processes(model_dir: Path, tmp_path: Path) -> None:
    args = {**_args(model_dir, tmp_path / "out"), "recipe": [_ObservesBelowItsParent(scheme="W4A16")]}
    assert wait_all(start(2, [args] * 2, tmp_path / "err"), timeout=120) == [1, 1]
    first = (tmp_path / "err" / "rank0.txt").read_text().splitlines()[0]
    assert "_ObservesBelowItsParent gathers statistics that do not yet reduce across processes" in first, (
        first
    )
    assert not (tmp_path / "out" / "config.json").exists()


def _drop_the_last_shard(rank: int) -> None:
    collect = ShardedRun.collect

    def all_but_last(
        self: ShardedRun, index: int, shard: int, modifiers: list, device: object, **kw: object
    ) -> None:
        if shard == self.plan.shards - 1:
            for m in modifiers:
                contract.partial_statistics(m)  # taken and thrown away
        collect(self, index, shard, modifiers, device, **kw)

    ShardedRun.collect = all_but_last  # in the forked child only


def test_an_outside_modifier_gives_the_same_bytes_for_1_and_2_processes(
    model_dir: Path, tmp_path: Path
) -> None:
    run(1, tmp_path / "e1", **_args(model_dir, tmp_path / "w1"))
    run(2, tmp_path / "e2", **_args(model_dir, tmp_path / "w2"))
    one, two = tensor_hashes(tmp_path / "w1"), tensor_hashes(tmp_path / "w2")
    assert len(one) > 10 and one == two
    run(1, tmp_path / "e3", _drop_the_last_shard, **_args(model_dir, tmp_path / "missing"))
    missing = tensor_hashes(tmp_path / "missing")
    assert [k for k in missing if missing[k] != one[k]], "the declared statistic changed no byte"
    saved = (tmp_path / "w1" / "recipe.yaml").read_text()
    assert "importance_clip:ImportanceClipModifier" in saved  # the written recipe names it so it runs again
    assert type(parse_recipe(saved).modifiers[0]).__name__ == "ImportanceClipModifier"


def test_an_outside_modifier_resumes_to_the_same_bytes(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    oneshot(**_args(model_dir, tmp_path / "clean"))
    out = tmp_path / "stopped"
    stopped_after(monkeypatch, 4, **_args(model_dir, out))
    oneshot(**_args(model_dir, out), resume=True)
    assert tensor_hashes(out) == tensor_hashes(tmp_path / "clean")
    # a directory without finished work: the resume says that it starts over, and why
    fresh = tmp_path / "fresh"
    with caplog.at_level("WARNING", logger="seqcal"):
        oneshot(**_args(model_dir, fresh), resume=True)
    assert "nothing to replay" in caplog.text and "starting from the first subgraph" in caplog.text


def test_import_path_errors_are_one_sentence() -> None:
    with pytest.raises(RecipeError, match="cannot import 'no_such_pkg.mod'.*PYTHONPATH"):
        parse_recipe("no_such_pkg.mod:MyModifier: {}")
    with pytest.raises(RecipeError, match="not a seqcal modifier class"):
        parse_recipe("json:JSONDecoder: {}")
    with pytest.raises(RecipeError, match="has no 'Nope'"):
        parse_recipe("importance_clip:Nope: {}")
    with pytest.raises(RecipeError, match="unknown argument|grid_size"):
        parse_recipe("importance_clip:ImportanceClipModifier: {grid_size: 3}")


def test_the_command_line_runs_a_modifier_named_by_import_path(smollm2_dir: Path, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    model = tmp_path / "tiny"
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(model)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((smollm2_dir / name).read_bytes())
    env = env_for_cli()
    env["PYTHONPATH"] = f"{EXAMPLES}:{env['PYTHONPATH']}"
    cli = [sys.executable, "-m", "seqcal.cli", "oneshot", "--model", str(model), "--recipe", str(RECIPE),
           "--output-dir", str(tmp_path / "out"), "--num-calibration-samples", "2", "--max-seq-length", "32"]  # fmt: skip
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == 32


@dataclass
class _ReferenceProbe(QuantizationModifier):
    """Round-to-nearest that records what the full-precision stream gave each module."""

    gathers = (
        Gather("ref_sum", lambda x, ref: ref.sum(0), reference=True),
        Gather("gap", lambda x, ref: (ref - x).abs().sum().reshape(1), reference=True),
    )
    needs_calibration = True

    def compress(self, subgraph, model, state) -> bool:  # noqa: ANN001
        self.__dict__.setdefault("seen", {}).update({n: self.gathered(n) for n in self.modules_in(subgraph)})
        return super().compress(subgraph, model, state)


@pytest.mark.parametrize("one_pass", [True, False])
def test_the_full_precision_stream_gives_each_module_the_unquantized_models_inputs(one_pass: bool) -> None:
    from save_helpers import tiny_llama

    model, reference = tiny_llama(), tiny_llama()
    reference.load_state_dict(model.state_dict())
    rows = [
        {"input_ids": [t % 128 for t in r["input_ids"]]} for r in data(4, 24)
    ]  # equal lengths: no padding
    sums: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: sums.__setitem__(n, sums.get(n, 0) + a[0].sum((0, 1))))
             for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)]  # fmt: skip
    with torch.no_grad():
        for row in rows:
            reference(input_ids=torch.tensor([row["input_ids"]]))
    for h in hooks:
        h.remove()
    channel = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    probe = _ReferenceProbe(
        config_groups={"g": {"targets": ["Linear"], "weights": channel}}, ignore=["lm_head"]
    )
    oneshot(model=model, dataset=rows, recipe=probe, one_pass=one_pass, max_seq_length=24, batch_size=1)
    assert set(probe.seen) == {n for n in sums if n != "lm_head"}
    for name, got in probe.seen.items():
        torch.testing.assert_close(got["ref_sum"], sums[name].float(), rtol=1e-4, atol=1e-3)
    first, last = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"
    assert probe.seen[first]["gap"].item() == 0  # nothing quantized before the first layer's inputs
    assert probe.seen[last]["gap"].item() > 0  # the calibration stream's inputs come from quantized layers
