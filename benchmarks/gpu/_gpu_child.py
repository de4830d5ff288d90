"""Run a benchmark runner script as __main__, then print its peak device and host memory (gpu_bench.py).

Usage: python benchmarks/gpu/_gpu_child.py benchmarks/_lib/run_seqcal.py --model ... (the runner's own arguments)
"""

from __future__ import annotations

import resource
import runpy
import sys

import torch


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(__import__("pathlib").Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
    device = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux
    print(f"peak device_gb {device:.3f} host_gb {host:.3f}")


if __name__ == "__main__":
    main()
