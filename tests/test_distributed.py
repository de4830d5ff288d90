"""Data-parallel calibration: the checkpoint has the same bytes for 1, 2 and 4 processes (gloo on the CPU)."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from dist_helpers import data, run, start, tensor_hashes, wait_all
from seqcal.distributed.reduce import fold
from seqcal.distributed.run import ShardedRun, load_statistics, partials_of
from seqcal.distributed.shards import ShardPlan, assign_owners
from seqcal.modifiers.base import Modifier, RunState, Statistic
from seqcal.tracing.partition import Subgraph

SAMPLES = 7  # divisible by neither 2 nor 4
# W8A16: its 8-bit codes flip on a Hessian that differs in the last bit (4-bit ones often do not)
RECIPE = "GPTQModifier: {scheme: W8A16, ignore: [lm_head], block_size: 32}"


def _save(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return _save(LlamaForCausalLM(config), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    return _save(Qwen3MoeForCausalLM(config), tmp_path_factory.mktemp("moe"))


def _args(model: Path, out: Path, **extra: object) -> dict:
    return {"model": str(model), "dataset": data(SAMPLES), "recipe": RECIPE, "max_seq_length": 40,
            "output_dir": str(out), **extra}  # fmt: skip


# static input scales (minmax observer: ranges averaged over the shards) besides GPTQ's Hessians
STATIC = "recipes/gptq_w8a8_static.yaml"
# NVFP4 input global scales (static_minmax: the shards' min of mins and max of maxes)
NVFP4 = "GPTQModifier: {scheme: NVFP4, ignore: [lm_head], block_size: 32}"


@pytest.mark.parametrize(
    ("arch", "recipe"),
    [("llama", RECIPE), ("moe", RECIPE), ("llama", STATIC), ("llama", NVFP4)],
    ids=["llama", "moe", "llama-static", "llama-nvfp4"],
)
def test_same_bytes_for_1_2_and_4_processes(
    arch: str, recipe: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """7 samples in 7 shards: per-tensor SHA-256 equal across world sizes (one-pass cut and layer cut)."""
    model = request.getfixturevalue(f"{arch}_dir")
    if recipe == STATIC:
        recipe = str(Path(__file__).parent.parent / STATIC)
    hashes = {}
    for world in (1, 2, 4):
        run(world, tmp_path / f"err{world}", **_args(model, tmp_path / f"w{world}", recipe=recipe))
        hashes[world] = tensor_hashes(tmp_path / f"w{world}")
        assert not (tmp_path / f"w{world}" / "seqcal_progress.json").exists()
        if arch == "moe" and world > 1:  # the layer cut: a layer's module groups solved by every process
            report = json.loads((tmp_path / f"w{world}" / "quantization_report.json").read_text())
            solvers = [s.get("solvers") for s in report["distributed"]["ranks"][0]["subgraphs"]]
            assert [world] * 2 == [len(s) for s in solvers if s], solvers
    assert len(hashes[1]) > 10
    assert hashes[2] == hashes[1]
    assert hashes[4] == hashes[1]


def _stash(
    self: ShardedRun, index: int, shard: int, modifiers: list, device: torch.device, **_: object
) -> None:
    self.stash = [*getattr(self, "stash", []), partials_of(modifiers)]


def _reversed_reduce(self: ShardedRun, index: int, modifiers: list, device: torch.device) -> None:
    """One process, the shards' statistics folded last shard first (not the fixed order)."""
    total = None
    for partial in reversed(self.stash):
        total = fold(total, partial)
    self.stash = []
    load_statistics(modifiers, total)


def _reverse_the_fold(rank: int) -> None:
    ShardedRun.collect, ShardedRun.reduce = _stash, _reversed_reduce  # in the forked child only


def test_negative_control_another_fold_order_changes_bytes(llama_dir: Path, tmp_path: Path) -> None:
    """The equality above can fail: the same shards folded in another order change at least one tensor."""
    run(1, tmp_path / "err1", **_args(llama_dir, tmp_path / "fixed"))
    run(1, tmp_path / "err2", _reverse_the_fold, **_args(llama_dir, tmp_path / "reversed"))
    fixed, other = tensor_hashes(tmp_path / "fixed"), tensor_hashes(tmp_path / "reversed")
    assert fixed.keys() == other.keys()
    assert [k for k in fixed if fixed[k] != other[k]], "folding in another order changed no byte"


def _finished(out: Path) -> int:
    try:
        return json.loads((out / "seqcal_progress.json").read_text())["progress"]["finished"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return -1


def _record_every_subgraph(rank: int, stall: int = -1) -> None:
    """Every finished subgraph recorded for a resume; rank 1 stops answering in subgraph ``stall`` (so that
    the kill comes midway however fast the run is)."""
    import seqcal.checkpoint.streaming

    seqcal.checkpoint.streaming.CHECKPOINT_BYTES = 1
    if rank == 1 and stall >= 0:
        reduce = ShardedRun.reduce

        def stalled(self: ShardedRun, index: int, *args: object, **kwargs: object) -> None:
            if index == stall:
                time.sleep(600)
            reduce(self, index, *args, **kwargs)

        ShardedRun.reduce = stalled  # in the forked child only


@pytest.mark.parametrize("arch", ["llama", "moe"])
def test_a_rank_killed_midway_stops_the_others_and_resumes_with_another_world_size(
    arch: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """SIGKILL one of 2 ranks midway: the other stops with a clear error in time, the directory holds no
    finished checkpoint, and resuming with 4 processes gives the bytes of an uninterrupted single process
    (the one-pass cut of a Llama; the layer cut of an MoE model, whose layers' groups are spread)."""
    model = request.getfixturevalue(f"{arch}_dir")
    stall = {"llama": 3, "moe": 1}[arch]
    run(1, tmp_path / "err_clean", **_args(model, tmp_path / "clean"))
    out = tmp_path / "killed"
    setup = functools.partial(_record_every_subgraph, stall=stall)
    procs = start(2, [_args(model, out)] * 2, tmp_path / "err_killed", setup)
    deadline = time.time() + 120
    while _finished(out) < stall - 1 and all(p.is_alive() for p in procs) and time.time() < deadline:
        time.sleep(0.01)
    assert _finished(out) == stall - 1, "the run did not get to the stalled subgraph"
    procs[1].kill()
    codes = wait_all(procs, timeout=90)
    assert codes[0] == 1 and not (out / "config.json").exists(), "the run finished before the kill"
    error = (tmp_path / "err_killed" / "rank0.txt").read_text().splitlines()[0]
    assert error.startswith("DistributedError: rank 0 of 2:") and "resume=True" in error, error
    run(4, tmp_path / "err_resume", **_args(model, out, resume=True))
    assert tensor_hashes(out) == tensor_hashes(tmp_path / "clean")


def test_ranks_started_with_different_recipes_stop_at_the_start(llama_dir: Path, tmp_path: Path) -> None:
    other = {**_args(llama_dir, tmp_path / "out"), "recipe": RECIPE.replace("W8A16", "W4A16")}
    codes = wait_all(start(2, [_args(llama_dir, tmp_path / "out"), other], tmp_path / "err"), timeout=120)
    assert codes == [1, 1]
    for rank in (0, 1):
        first = (tmp_path / "err" / f"rank{rank}.txt").read_text().splitlines()[0]
        assert "started with different arguments, recipes, models or data" in first, first
    assert not any(p.name.endswith(".safetensors") for p in (tmp_path / "out").glob("*"))


def test_more_processes_than_samples_is_refused_on_every_rank(llama_dir: Path, tmp_path: Path) -> None:
    args = {**_args(llama_dir, tmp_path / "out"), "dataset": data(3)}
    codes = wait_all(start(4, [args] * 4, tmp_path / "err"), timeout=120)
    assert codes == [1, 1, 1, 1]
    for rank in range(4):
        first = (tmp_path / "err" / f"rank{rank}.txt").read_text().splitlines()[0]
        assert "4 processes but only 3 virtual shards (3 calibration batches" in first, first


def test_shard_plan_does_not_depend_on_the_world_size() -> None:
    for world in (1, 2, 3, 7):
        plan = ShardPlan(num_batches=7, num_shards=8, world_size=world)
        assert plan.shards == 7
        assert [b for s in range(plan.shards) for b in plan.batches_of(s)] == list(range(7))
        assert sorted(s for r in range(world) for s in plan.shards_of(r)) == list(range(7))
    assert ShardPlan(100, 8, 4).batches_of(7) == range(87, 100)
    assert assign_owners([5.0, 1.0, 1.0, 1.0, 1.0], 2) == [0, 1, 1, 1, 1]


def test_two_torchrun_nodes_give_the_checkpoint_of_one_process(llama_dir: Path, tmp_path: Path) -> None:
    """Two ``torchrun --nnodes 2`` launchers on 127.0.0.1 (c10d rendezvous) running ``seqcal oneshot``, against
    the same command in one process: the same bytes, and only rank 0 wrote the output directory."""
    import subprocess
    import sys

    from dist_helpers import env_for_cli, free_port

    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in data(SAMPLES)))
    cli = ["-m", "seqcal.cli", "oneshot", "--model", str(llama_dir), "--dataset", str(dataset), "--recipe", RECIPE,
           "--max-seq-length", "40", "--num-calibration-samples", str(SAMPLES), "-q", "--plot", "none"]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "seqcal-test"]  # fmt: skip
    nodes = [subprocess.Popen([*torchrun, "--node-rank", str(n), *cli, "--output-dir", str(tmp_path / "two")],
                              env=env_for_cli(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in range(2)]  # fmt: skip
    single = subprocess.run([sys.executable, *cli, "--output-dir", str(tmp_path / "one")], env=env_for_cli(),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert single.returncode == 0, single.stderr[-2000:]
    for node in nodes:
        _, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-3000:]
    assert tensor_hashes(tmp_path / "two") == tensor_hashes(tmp_path / "one")


def test_plan_predicts_owners_and_bytes_of_a_two_process_run(llama_dir: Path, tmp_path: Path) -> None:
    """``seqcal plan --world-size 2``'s numbers against a run's quantization_report.json: the same owners,
    statistics bytes within 2% (+1 kB of headers), weight bytes within 5% per subgraph."""
    from seqcal.distributed.plan import world_rows
    from seqcal.entrypoint import oneshot

    trace = tmp_path / "run.trace.json"
    run(2, tmp_path / "err", **_args(llama_dir, tmp_path / "out", profile=str(trace)))
    report = json.loads((tmp_path / "out" / "quantization_report.json").read_text())["distributed"]
    events = json.loads(trace.read_text())["traceEvents"]  # one trace: a process per rank
    waiting = {e["pid"] for e in events if e.get("cat") == "communication" and e["ph"] == "X"}
    assert waiting == {1, 2} and not list(tmp_path.glob("run.trace.rank*"))
    plan = oneshot(model=str(llama_dir), recipe=RECIPE, num_calibration_samples=SAMPLES, max_seq_length=40,
                   dry_run=True, dataset=[])  # fmt: skip
    rows = world_rows(plan, 2, 8, SAMPLES, plan.dtype_bytes)
    assert [r["owner"] for r in rows] == report["owners"]
    sent: dict[int, dict[str, int]] = {}
    for rank in report["ranks"]:
        for s in rank["subgraphs"]:
            got = sent.setdefault(s["subgraph"], {"reduce": 0, "broadcast": 0})
            got["reduce"] += s.get("reduce_bytes", 0)
            got["broadcast"] = max(got["broadcast"], s.get("broadcast_bytes", 0))
    checked = 0
    for r in rows:
        if r["reduce_bytes"] == 0:
            continue
        got = sent[r["index"]]
        assert abs(got["reduce"] - r["reduce_bytes"]) <= 0.02 * r["reduce_bytes"] + 1024, (r, got)
        assert abs(got["broadcast"] - r["broadcast_bytes"]) <= 0.05 * r["broadcast_bytes"], (r, got)
        checked += 1
    assert checked >= 7


@dataclass
class _InputStats(Modifier):
    """A new modifier with two statistics (tokens: sum, largest |input|: max) and no reduction code of its own."""

    name: ClassVar[str] = "InputStats"
    needs_calibration: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.partial: dict[str, dict[str, Statistic]] = {}
        self.shards, self.totals, self.seen = 0, {}, {}

    @contextlib.contextmanager
    def calibrate(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: object
    ) -> Iterator[None]:
        under = tuple(f"{m}." for m in subgraph.modules)
        handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and name.startswith(under)]  # fmt: skip
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, name: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            stats = self.partial.setdefault(name, {"tokens": Statistic(torch.zeros(1, dtype=torch.int64)),
                                                   "absmax": Statistic(torch.zeros(()), "max")})  # fmt: skip
            stats["tokens"].tensor += x.shape[0]
            stats["absmax"].tensor = torch.maximum(stats["absmax"].tensor, x.abs().max())
            seen = self.seen.setdefault(name, [0, 0.0])  # the truth, over every batch at once
            seen[0], seen[1] = seen[0] + x.shape[0], max(seen[1], x.abs().max().item())

        return hook

    def partial_statistics(self) -> dict[str, dict[str, Statistic]]:
        out, self.partial = self.partial, {}
        self.shards += bool(out)
        return out

    def load_statistics(self, reduced: dict[str, dict[str, torch.Tensor]]) -> None:
        self.totals.update(reduced)


def test_a_new_modifier_gets_its_statistics_reduced_per_shard() -> None:
    """A modifier that only returns partial statistics sees them summed (tokens) and maxed (|x|) over the
    shards, equal to what it would have counted over every batch at once."""
    from seqcal.entrypoint import oneshot

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    stats = _InputStats()
    oneshot(model=LlamaForCausalLM(config), dataset=data(SAMPLES), recipe=[stats], max_seq_length=40)
    assert stats.shards == SAMPLES * 2  # one partial per shard of each of the 2 layers
    assert len(stats.totals) == 14  # 7 Linears per layer
    for name, (tokens, absmax) in stats.seen.items():
        assert stats.totals[name]["tokens"].item() == tokens == SAMPLES * 40
        assert stats.totals[name]["absmax"].item() == absmax


def _split_run(world: int, rank: int, together: tuple = ()) -> ShardedRun:
    from seqcal.distributed.group import ProcessGroup

    shapes = {"l.q": (64, 32), "l.k": (16, 32), "l.v": (16, 32), "l.o": (32, 64), "l.up": (128, 32),
              "l.gate": (128, 32), "l.down": (32, 128)}  # fmt: skip
    return ShardedRun(ShardPlan(4, 4, world), ProcessGroup(rank, world), [1.0], shapes, together)


def test_module_groups_of_a_subgraph_are_spread_by_solve_cost() -> None:
    """The groups named by the statistic keys (q/k/v share a Hessian) go to the least loaded process, largest
    first; a fused group stays whole even when its members have keys of their own; what no key names (and
    the keys of no module) stays with the subgraph's owner, whose share of the subgraph still holds it."""
    stat = {"n": Statistic(torch.ones(1))}

    class _Quantizer(Modifier):
        pass

    keys = {"0/hessian:l.k,l.q,l.v": stat, "0/hessian:l.o": stat, "0/input:l.up": stat, "0/input:l.gate": stat,
            "0/hessian:l.down": stat, "0/kv:l.attn:k": stat}  # fmt: skip
    run = _split_run(2, 0, together=[("l.gate", "l.up")])
    parts = run._assign_parts(keys, [_Quantizer()])
    # costs sum(out) * in^2 + in^3: down 32*128^2 + 128^3 = 2.6M; o 0.39M; gate/up 0.29M; q/k/v 0.13M
    assert parts == {"l.down": 0, "l.o": 1, "l.gate": 1, "l.up": 1, "l.q": 1, "l.k": 1, "l.v": 1}
    one = _split_run(2, 0)._assign_parts({"0/hessian:l.o": stat}, [_Quantizer()])
    assert one == {}  # one group: the owner solves it
    run.parts, run._folders = parts, [0, 1]
    assert set(run._part_for(keys, 0, 0, [_Quantizer()])) == {"0/hessian:l.down", "0/kv:l.attn:k"}
    sg = Subgraph(0, [], targets=["l.q", "l.down"], modules=["l"])
    mine, owner = _split_run(2, 1), run
    mine.parts = parts
    assert [n for n in ("l.q", "l.down", "l.attn") if mine.part(sg).holds(n)] == ["l.q"]
    assert mine.part(sg).targets == ["l.q"]
    assert [n for n in ("l.q", "l.down", "l.attn") if owner.part(sg).holds(n)] == ["l.down", "l.attn"]
    assert _split_run(4, 3).part(sg) is None  # no group, not the owner: compresses nothing
