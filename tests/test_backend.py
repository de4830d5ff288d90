"""The backend's private torch operators are checked before use, and a library call leaves the process as it found it.

``torch.ops.mkldnn._linear_pointwise`` is private: a torch upgrade may drop it or change what it computes. The
check (``linear_pointwise_problem``) must say so, ``SEQCAL_CPU_MATMUL=onednn`` must refuse, and this file must
fail on such a torch instead of the products quietly moving to slower kernels. ``oneshot`` is a library call:
the environment variables, glibc's allocator settings and torch's thread count are the caller's process's.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import seqcal.backend.onednn as kernels


@pytest.fixture
def fresh_choice(monkeypatch: pytest.MonkeyPatch):
    """``use_onednn`` and the operator check computed again inside the test, and again after it."""
    cached = (kernels.use_onednn, kernels.linear_pointwise_problem)  # the test may patch the names
    for function in cached:
        function.cache_clear()
    yield monkeypatch
    for function in cached:
        function.cache_clear()


def test_the_private_onednn_operator_is_there_and_gives_the_public_result(fresh_choice) -> None:
    """Fails on a oneDNN build of torch whose ``_linear_pointwise`` is gone or computes something else."""
    problem = kernels.linear_pointwise_problem()
    if not torch.backends.mkldnn.is_available():
        assert problem is not None and "without oneDNN" in problem
        return
    assert problem is None, f"the oneDNN backend cannot run on this torch {torch.__version__}: {problem}"
    x, w, b = torch.randn(64, 96), torch.randn(80, 96), torch.randn(80)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert torch.allclose(kernels._linear_pointwise(x, w, b).double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(kernels.matmul_nt(x, w).double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)


def test_an_operator_with_other_results_is_caught(fresh_choice) -> None:
    real = kernels._linear_pointwise
    fresh_choice.setattr(kernels, "_linear_pointwise", lambda x, w, b: real(x, w, b) + 1e-3)
    problem = kernels.linear_pointwise_problem()
    assert problem is not None
    if torch.backends.mkldnn.is_available():
        assert "other results" in problem


def test_a_missing_operator_is_refused_when_asked_for_and_reported_otherwise(fresh_choice, caplog) -> None:
    fresh_choice.setattr(kernels, "linear_pointwise_problem", lambda: "torch 9.9 has no such operator")
    fresh_choice.setenv("SEQCAL_CPU_MATMUL", "onednn")
    with pytest.raises(RuntimeError, match="SEQCAL_CPU_MATMUL=onednn, but torch 9.9 has no such operator"):
        kernels.use_onednn()
    kernels.use_onednn.cache_clear()
    fresh_choice.setenv("SEQCAL_CPU_MATMUL", "auto")
    fresh_choice.setattr(kernels, "_mkl_blas", lambda: True)  # the machine where auto picks oneDNN
    fresh_choice.setattr(kernels, "_cpu_vendor", lambda: "AuthenticAMD")
    with caplog.at_level(logging.WARNING, logger="seqcal"):
        assert kernels.use_onednn() is False
    assert "torch 9.9 has no such operator" in caplog.text


def test_the_check_draws_no_random_numbers_of_the_run(fresh_choice) -> None:
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    kernels.linear_pointwise_problem()
    assert torch.equal(torch.rand(4), want)


# Runs oneshot on a tiny Llama in a fresh process and prints what it changed of the process: the environment,
# the mallopt calls (every one goes through backend.host._mallopt), torch's intra-op threads. Then the same for
# the seqcal command's main, which owns its process and does set the allocator.
PROCESS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import seqcal.backend.host as host

    calls = []
    host._mallopt = lambda parameter, value: calls.append([parameter, value]) or True
    from transformers import LlamaConfig, LlamaForCausalLM
    from seqcal import GPTQModifier, oneshot

    def snapshot():
        return {"environ": dict(os.environ), "mallopt": list(calls), "threads": torch.get_num_threads()}

    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config).eval()
    data = [{"input_ids": [(7 * i + j) % 64 for j in range(40)]} for i in range(4)]
    before = snapshot()
    oneshot(model=model, dataset=data, recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
            output_dir=sys.argv[1], max_seq_length=40)
    after_oneshot = snapshot()
    import seqcal.cli as cli
    try:
        cli.main(["--help"])
    except SystemExit:
        pass
    print(json.dumps({"before": before, "oneshot": after_oneshot, "cli": snapshot()}))
""")


def test_oneshot_leaves_the_environment_allocator_and_threads_as_it_found_them(tmp_path: Path) -> None:
    import json

    env = {k: v for k, v in os.environ.items()
           if "CACHE_CAPACITY" not in k and not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}  # fmt: skip
    run = subprocess.run([sys.executable, "-c", PROCESS_SCRIPT, str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=300, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.splitlines()[-1])
    before, after, cli = seen["before"], seen["oneshot"], seen["cli"]
    assert (tmp_path / "out" / "config.json").is_file()  # the run did run
    changed = {
        k
        for k in {*before["environ"], *after["environ"]}
        if before["environ"].get(k) != after["environ"].get(k)
    }
    assert not changed, f"oneshot left these environment variables changed: {sorted(changed)}"
    assert after["mallopt"] == [], "oneshot called mallopt: glibc's thresholds belong to the process"
    assert after["threads"] == before["threads"]
    # the check can fail: the command's main, which owns its process, does both
    assert cli["environ"].get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == "32"
    assert len(cli["mallopt"]) == 2 if sys.platform.startswith("linux") else cli["mallopt"] == []


def test_mallopt_is_called_in_one_place_only() -> None:
    """Every allocator setting goes through backend.host._mallopt, the one the process test watches."""
    root = Path(__file__).parent.parent / "src" / "seqcal"
    callers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if ".mallopt" in p.read_text())
    assert callers == ["backend/host.py"]
    assert (root / "backend" / "host.py").read_text().count(".mallopt") == 1
