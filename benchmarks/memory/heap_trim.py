"""What handing the free heap back after every subgraph costs: time, page faults and peak RSS side by side.

seqcal trims glibc's heap (``backend.host.trim_host_memory``) after each subgraph's calibration and after
its release, so that RSS falls back to what is alive. Every page a trim hands back is faulted in again (and
zeroed) when a later subgraph allocates as much. This runs the same GPTQ W4A16 job (``run_seqcal.py``) once
per trimming policy, each in its own process, and prints wall seconds, user / system CPU seconds, minor page
faults and peak RSS of that process (``os.wait4``):

- ``every``: seqcal's policy (no change).
- ``never``: no ``malloc_trim`` at all (MKL's pooled buffers are still handed back to the heap).
- ``peak``: trim only when the process's peak RSS (``VmHWM``) rose by 1/32 (at least 32 MiB) since the
  last trim.
- ``every8``: trim at every eighth call.
- ``unused32`` / ``unused64``: trim when the resident bytes the C heap does not account for (RSS minus glibc's
  ``mallinfo2`` in-use bytes) grew by 32 / 64 MiB since the last trim.
- ``nomkl``: every trim, but without handing MKL's buffer pool back first.

glibc's own settings apply to every policy through the environment, e.g.
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576`` (each allocation of 1 MiB or more its own mapping).

Example (fp32 SmolLM2, 32 x 512 tokens; run one at a time on a quiet machine)::

    PYTHONPATH=src:benchmarks/_lib HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/memory/heap_trim.py \\
        --model ~/.cache/seqcal/smollm2-135m-instruct --tokens benchmarks/.work/calib_32x512.safetensors
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Run in the child before run_seqcal.py: replaces the trim the executor and the weight release call.
CHILD = textwrap.dedent("""
    import ctypes, os, runpy, sys
    import seqcal.execution.one_subgraph as one_subgraph
    import seqcal.backend.host as host
    import seqcal.execution.weights as weights

    policy, script, calls, last_peak = sys.argv[1], sys.argv[2], [0], [0]

    def peak_bytes():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost")]

    libc, page, floor = ctypes.CDLL(None), os.sysconf("SC_PAGE_SIZE"), [None]
    libc.mallinfo2.restype = Mallinfo2

    def unused_resident():  # resident bytes beyond what the C heap has handed out and not taken back
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * page
        info = libc.mallinfo2()
        return rss - info.uordblks - info.hblkhd

    def trim():
        calls[0] += 1
        if policy == "nomkl":  # every trim, but MKL's buffer pool stays
            free_mkl, host.free_mkl_buffers = host.free_mkl_buffers, lambda: True
            try:
                return host.trim_host_memory()
            finally:
                host.free_mkl_buffers = free_mkl
        if policy.startswith("unused"):  # trim when the unused resident bytes grew by N MiB since the last trim
            if floor[0] is not None and unused_resident() <= floor[0] + (int(policy[6:]) << 20):
                host.free_mkl_buffers()
                return False
            trimmed = host.trim_host_memory()
            floor[0] = unused_resident()
            return trimmed
        skip = policy == "never" or (policy == "every8" and calls[0] % 8 != 1)
        if policy == "peak":
            peak = peak_bytes()
            skip = bool(last_peak[0]) and peak <= last_peak[0] + max(32 << 20, last_peak[0] // 32)
            last_peak[0] = last_peak[0] if skip else peak
        if skip:  # MKL's pooled buffers still go back to the heap, as in every trim
            host.free_mkl_buffers()
            return False
        return host.trim_host_memory()

    if policy != "every":
        one_subgraph.trim_host_memory = weights.trim_host_memory = trim
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")
""")

POLICIES = ("every", "never", "peak", "every8", "unused32", "unused64", "nomkl")


def run(policy: str, args: argparse.Namespace, out: str) -> tuple[float, resource.struct_rusage]:
    """One ``run_seqcal.py`` process under ``policy``: its wall seconds and its own rusage (``os.wait4``)."""
    command = [sys.executable, "-c", CHILD, policy, str(HERE.parent / "_lib" / "run_seqcal.py"), "--model", args.model,
               "--tokens", args.tokens, "--out", out]  # fmt: skip
    with tempfile.TemporaryFile(mode="w+") as log:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        if child.returncode != 0:
            log.seek(0)
            raise SystemExit(f"{policy}: the run failed\n{log.read()[-2000:]}")
    return wall, usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True, help="safetensors file of input_ids (calib_tokens.py)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    policies = args.policies.split(",")
    if unknown := [p for p in policies if p not in POLICIES]:
        raise SystemExit(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    print(f"{'policy':>8} {'wall s':>8} {'user s':>8} {'sys s':>7} {'faults':>10} {'peak RSS MB':>12}")
    for policy in policies:
        with tempfile.TemporaryDirectory(prefix="seqcal-trim-") as out:
            wall, usage = run(policy, args, os.path.join(out, "checkpoint"))
        print(
            f"{policy:>8} {wall:8.1f} {usage.ru_utime:8.1f} {usage.ru_stime:7.1f} {usage.ru_minflt:10d} "
            f"{usage.ru_maxrss / 1024:12.0f}",
            flush=True,
        )  # ru_maxrss: KiB on Linux


if __name__ == "__main__":
    main()
