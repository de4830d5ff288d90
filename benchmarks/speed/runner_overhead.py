"""What the subgraph interpreter (``GraphRunner``) costs per node in a real run, against the nodes' own work.

A subgraph is evaluated node by node in Python (runtime resolution of modules and offloaded weights); generated
code (an fx ``GraphModule`` per subgraph, or ``torch.compile``) could only save the interpreter's own time: the
loop, argument loading and error wrapping around each node call. This times a GPTQ W4A16 run of SmolLM2 with
both measured: time inside ``GraphRunner._run`` and time inside its node calls; the difference is the interpreter.

    PYTHONPATH=src:benchmarks/_lib HF_HUB_OFFLINE=1 python benchmarks/speed/runner_overhead.py \\
        --model ~/.cache/seqcal/smollm2-135m-instruct --tokens benchmarks/.work/calib_32x512.safetensors --samples 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

import seqcal.execution.executor as executor
from seqcal.entrypoint import oneshot
from seqcal.modifiers import GPTQModifier

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
from scheme import SCHEME  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True, help="safetensors file with input_ids [samples, length]")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    totals = {"_run": 0.0, "_call": 0.0, "runs": 0, "nodes": 0}

    def timed(name: str, count: str) -> Any:
        """GraphRunner's method ``name`` with its seconds added to ``totals[name]`` and its calls counted."""
        method = getattr(executor.GraphRunner, name)

        def wrapper(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                totals[name] += time.perf_counter() - start
                totals[count] += 1

        return wrapper

    executor.GraphRunner._run = timed("_run", "runs")
    executor.GraphRunner._call = timed("_call", "nodes")
    tokens = load_file(args.tokens)["input_ids"][: args.samples]
    data = [{"input_ids": row.tolist()} for row in tokens]
    start = time.perf_counter()
    oneshot(model=str(Path(args.model).expanduser()), dataset=data, recipe=GPTQModifier(config_groups=SCHEME,
            ignore=["lm_head"]), num_calibration_samples=len(data), max_seq_length=tokens.shape[1],
            dtype=args.dtype, shuffle_calibration_samples=False)  # fmt: skip
    wall = time.perf_counter() - start
    interpreter = totals["_run"] - totals["_call"]
    print(
        f"run {wall:.1f} s: {totals['runs']} subgraph runs, {totals['nodes']} node calls; inside the runner "
        f"{totals['_run']:.2f} s, in node calls {totals['_call']:.2f} s, the interpreter itself {interpreter:.2f} s "
        f"({interpreter / max(totals['nodes'], 1) * 1e6:.1f} us per node, {interpreter / wall:.1%} of the run)"
    )


if __name__ == "__main__":
    main()
