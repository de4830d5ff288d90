"""The shards' fold with its large sums in temporary files between shards (``distributed.reduce.SpilledSum``):
the same bits as the fold in RAM, one Hessian in memory at a time, and a plan that counts it so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import seqcal.distributed.reduce as reduce
import seqcal.plan as plan_module
from dist_helpers import data, tensor_hashes
from seqcal.distributed.group import ProcessGroup
from seqcal.distributed.reduce import SpilledSum, fold
from seqcal.distributed.run import ShardedRun
from seqcal.distributed.shards import ShardPlan
from seqcal.entrypoint import oneshot
from seqcal.modifiers import GPTQModifier
from seqcal.plan import make_plan
from seqcal.records import Statistic


def _awkward(n: int, seed: int) -> torch.Tensor:
    """float32 values that make addition order visible: wide exponents, signed zeros, subnormals, infinities."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    t[:8] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, float("inf"), 3.4e38, -3.4e38, 1e-40])
    return t


def test_a_spilled_sum_added_into_the_next_gives_the_bits_of_the_fold() -> None:
    total, partial = _awkward(300_000, 1), _awkward(300_000, 2)  # more than one strip
    want = total.clone().add_(partial)
    got = SpilledSum(total).add_to(partial.clone())
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def _partial(shard: int) -> dict:
    g = torch.Generator().manual_seed(shard)
    H = torch.randn(64, 64, generator=g)
    return {"0/hessian:a": {"H": Statistic(H @ H.T), "tokens": Statistic(torch.tensor([5 + shard]))},
            "0/norms:b": {"max": Statistic(torch.randn(64, generator=g), "max")}}  # fmt: skip


def test_the_sharded_fold_with_spilled_sums_equals_the_fold_in_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reduce, "SPILL_BYTES", 1024)  # the 64 x 64 Hessian (16 KiB) spills, the rest stays
    run = ShardedRun(ShardPlan(8, 8, 1), ProcessGroup(), [1.0])
    run._start(0)
    want = None
    for shard in range(8):
        want = fold(want, _partial(shard))
        run._fold(_partial(shard), shard)
        if shard < 7:  # between shards the Hessian's sum waits on disk; the small and the max ones in RAM
            assert "H" not in run._total["0/hessian:a"] and "tokens" in run._total["0/hessian:a"]
            assert list(run._spilled) == [("0/hessian:a", "H")]
            assert "max" in run._total["0/norms:b"]
    assert not run._spilled  # the last shard's fold brought it back
    for key, stats in want.items():
        for name, stat in stats.items():
            assert torch.equal(run._total[key][name].tensor, stat.tensor), (key, name)


def test_a_sum_the_last_shards_lack_is_read_back_for_the_solve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reduce, "SPILL_BYTES", 1024)
    run = ShardedRun(ShardPlan(8, 8, 1), ProcessGroup(), [1.0])
    run._start(0)
    first = _partial(0)
    H = first["0/hessian:a"]["H"].tensor.clone()
    run._fold(first, 0)
    run._fold({}, 1)  # an expert that got no token in the second shard: its sum stays spilled
    assert run._spilled
    total = reduce.restore_sums(run._total, run._spilled)
    assert torch.equal(total["0/hessian:a"]["H"].tensor, H) and not run._spilled


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_a_gptq_checkpoint_has_the_same_bytes_with_every_hessian_spilled(
    wide_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = (
        "GPTQModifier: {scheme: W8A16, ignore: [lm_head], block_size: 32}"  # 8-bit codes flip on a last bit
    )
    kw = {"model": str(wide_llama), "dataset": data(7), "recipe": recipe, "max_seq_length": 40}
    oneshot(output_dir=str(tmp_path / "ram"), **kw)
    monkeypatch.setattr(reduce, "SPILL_BYTES", 0)  # every sum, Hessians and token counts, through a file
    spilled = []
    original = SpilledSum.__init__

    def counting(self: SpilledSum, tensor: torch.Tensor) -> None:
        spilled.append(tuple(tensor.shape))
        original(self, tensor)

    monkeypatch.setattr(SpilledSum, "__init__", counting)
    oneshot(output_dir=str(tmp_path / "disk"), **kw)
    assert (128, 128) in spilled and (256, 256) in spilled  # q/k/v's and down_proj's Hessians went to disk
    ram, disk = tensor_hashes(tmp_path / "ram"), tensor_hashes(tmp_path / "disk")
    assert ram and ram == disk


def test_the_plan_counts_no_second_copy_of_a_hessian_that_waits_on_disk(
    wide_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = LlamaForCausalLM.from_pretrained(wide_llama)
    kw = dict(num_samples=8, seq_len=32, batch_size=1, sequential_targets=None, tracing_ignore=[])

    def accumulators() -> list[int]:
        modifier = GPTQModifier(scheme="W4A16", ignore=["lm_head"])
        modifier.validate(model)  # resolves its modules, as oneshot does before planning
        plan = make_plan(model, [modifier], **kw)
        return [r.accumulators for r in plan.rows if r.hessians]

    in_ram = accumulators()
    monkeypatch.setattr(plan_module, "SPILL_BYTES", 256 * 256 * 4)  # down_proj's 256-wide Hessian spills
    on_disk = accumulators()
    assert len(in_ram) == len(on_disk) >= 2
    assert in_ram[-1] - on_disk[-1] == 256 * 256 * 4  # down_proj: no second Hessian
    assert in_ram[:-1] == on_disk[:-1]  # q/k/v, o, gate/up: 128 wide, below it
