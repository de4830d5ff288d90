"""The host budget is a promise: a run the plan says stays under ``max_host_memory`` does, measured in a process of
its own (``ru_maxrss``), and the plan's prediction is close to what the process reaches.

The model is small but its MLP is wide (a 4096-wide down_proj: a 64 MiB Hessian, its factor and kept triangle), so
the solve and the cache weigh beside the process itself; it is read from disk per subgraph, as a large model is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from seqcal.execution.cuts import onloaded_modules
from seqcal.execution.subgraphs import trace_subgraphs
from seqcal.plan.host import BUDGET_MARGIN
from seqcal.tracing.partition import Subgraph

ROOT = Path(__file__).resolve().parent.parent

# In a fresh process: the plan without a budget (dry run), then the run with the least budget that keeps its
# predicted peak (the peak and the plan's margin).
CHILD = """
import json, sys, torch
from seqcal import oneshot
from seqcal.plan.host import BUDGET_MARGIN
model, out, samples = sys.argv[1], sys.argv[2], int(sys.argv[3])
g = torch.Generator().manual_seed(0)
data = [{"input_ids": torch.randint(0, 512, (64,), generator=g).tolist()} for _ in range(samples)]
args = dict(model=model, recipe="GPTQModifier: {scheme: W4A16, ignore: [lm_head]}", max_seq_length=64,
            num_calibration_samples=samples, batch_size=1)
plan = oneshot(dataset=[], dry_run=True, **args)
budget = int(plan.host_peak / (1 - BUDGET_MARGIN)) + 1
oneshot(dataset=data, output_dir=out, max_host_memory=budget, **args)
print(json.dumps({"planned": budget}))
"""


@pytest.fixture(scope="module")
def wide_mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=4096, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    path = tmp_path_factory.mktemp("wide-mlp")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def test_a_budget_the_plan_keeps_is_kept_by_the_process(wide_mlp: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHILD, str(wide_mlp), str(tmp_path / "out"), "8"],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    planned = json.loads(done.stdout.strip().splitlines()[-1])["planned"]
    report = json.loads((tmp_path / "out" / "quantization_report.json").read_text())["host_memory"]
    budget, predicted, measured = report["max_host_memory"], report["predicted_peak"], report["measured_peak"]
    assert budget == planned and predicted <= budget * (1 - BUDGET_MARGIN)  # kept: the whole cache in RAM
    assert report["cache_max_memory"] is None
    assert measured <= budget, (
        f"the process reached {measured / 2**20:.0f} MiB over a kept {budget / 2**20:.0f}"
    )
    assert abs(predicted - measured) <= 0.10 * measured  # the prediction within 10% of the process's peak


def test_the_last_subgraph_of_the_one_pass_cut_onloads_only_its_target() -> None:
    """The lm_head after the last down_proj is not read for a subgraph that runs no forward pass."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.zeros(1, 8, dtype=torch.long)
    linears = "re:.*(q|k|v|o|gate|up|down)_proj$"
    subgraphs = trace_subgraphs(model, {"input_ids": ids}, [linears], [], None, 1, cut="before", verify=False)
    last: Subgraph = subgraphs[-1]
    assert last.targets == ["model.layers.0.mlp.down_proj"] and not last.outputs
    assert "lm_head" in last.modules and onloaded_modules(last) == ["model.layers.0.mlp.down_proj"]
    assert all(onloaded_modules(sg) == sg.modules for sg in subgraphs if sg.outputs)


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_spilled_kept_hessian_is_restored_bit_for_bit_and_holds_no_memory(symmetric: bool) -> None:
    from seqcal.algorithms.hessian import symmetrize_upper
    from seqcal.algorithms.kept_hessian import SPILL_BYTES, KeptHessian, kept_in_ram

    H = torch.randn(600, 600, generator=torch.Generator().manual_seed(0))
    H = symmetrize_upper(H) if symmetric else H
    before, kept = H.clone(), KeptHessian(H, spill=True)
    assert kept.file is not None and kept.blocks == []  # nothing of it in RAM
    for _ in range(2):  # a retry reads it again
        assert torch.equal(kept.restore(H.fill_(0.0)), before)
    assert KeptHessian(H).file is None  # small: in memory
    wide = 1 + int((SPILL_BYTES / 2) ** 0.5)  # about half of n^2 floats reaches the threshold
    assert kept_in_ram(wide) == 0 and kept_in_ram(wide, "cuda") > SPILL_BYTES and kept_in_ram(600) > 0


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_a_run_started_from_a_large_process_measures_its_own_peak() -> None:
    """``ru_maxrss`` survives fork and exec: the peak a child reports must be its own, not its parent's."""
    ballast = torch.ones(256 * 2**20, dtype=torch.uint8)  # 256 MiB resident in this process when it forks
    child = "from seqcal.plan.host import measured_peak; import resource; " \
            "print(measured_peak(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    own, inherited = (int(v) for v in done.stdout.split())
    parent = int(next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmRSS:"))
                 .split()[1]) * 1024  # fmt: skip
    assert ballast.numel() and inherited >= parent - 64 * 2**20  # the parent's size, as ru_maxrss has it
    assert own < parent - 128 * 2**20  # the child's own peak: the imports, without the parent's ballast
