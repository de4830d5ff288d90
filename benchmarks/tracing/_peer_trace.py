"""The llm-compressor 0.14 side of ``benchmarks/tracing/trace_matrix.py``; runs inside ``.peer-venv``.

It reproduces what ``llmcompressor.pipelines.sequential.SequentialPipeline`` does with default
arguments, minus the modifiers:

- targets: ``infer_sequential_targets(model, DatasetArguments().sequential_targets)``, i.e. the
  model's ``_no_split_modules``; ignore list: ``DatasetArguments().tracing_ignore``;
- ``set_onload_device(model, cpu)`` then ``trace_subgraphs(model, sample, targets, ignore, 1)``;
- execution: an ``IntermediatesCache`` holding the batch; subgraph ``i`` gets the cached values
  named in its ``input_names``, its outputs are added and its ``consumed_names`` dropped. For most
  models the last subgraph returns ``{}`` (the traced graph has no output node), so ``evaluate``
  compares the last leaf module's output (lm_head) and every target's outputs instead.

The pipeline runs subgraphs inside ``calibration_forward_context``; this script enters the same
contexts (no_grad, no KV cache, eval, no hub kernels, forced eager attention, quantization off)
except ``disable_lm_head``, which makes the logits meta tensors and would leave nothing to compare.

Usage (by the orchestrator): ``.peer-venv/bin/python benchmarks/tracing/_peer_trace.py --worker ARCH``
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_matrix import REPO, Adapter, worker_main  # noqa: E402


def _zoo_classes(arch: str) -> set[str]:
    sys.path.insert(0, str(REPO / "tests"))
    from zoo import ARCHS

    spec = ARCHS[arch]
    return {spec.target_class, *spec.other_targets}


def peer_trace(model: torch.nn.Module, sample: dict[str, Any], arch: str) -> tuple[list[Any], int, str]:
    """Trace as SequentialPipeline does by default: (subgraphs, count, note on its targets).

    The note lists the inferred target classes when they differ from the zoo's, and the number
    of matched target modules when the count is not that number + 1 (the peer's own warning).
    """
    from compressed_tensors.offload import set_onload_device
    from llmcompressor.args.dataset_arguments import DatasetArguments
    from llmcompressor.pipelines.sequential.helpers import trace_subgraphs
    from llmcompressor.utils.pytorch.module import infer_sequential_targets

    args = DatasetArguments()
    targets = infer_sequential_targets(model, args.sequential_targets)
    set_onload_device(model, torch.device("cpu"))
    subgraphs = trace_subgraphs(
        model, sample, targets, args.tracing_ignore, args.sequential_targets_per_subgraph
    )
    notes = []
    names = [targets] if isinstance(targets, str) else list(targets)
    if set(names) != _zoo_classes(arch):
        notes.append(f"peer targets {sorted(names)}")
    matched = sum(type(m).__name__ in names for m in model.modules())
    if len(subgraphs) != matched + 1:
        notes.append(f"{matched} modules match the peer's targets, {len(subgraphs)} subgraphs")
    return subgraphs, len(subgraphs), "; ".join(notes)


@contextlib.contextmanager
def calibration_settings(model: torch.nn.Module) -> Iterator[None]:
    """``calibration_forward_context`` without ``disable_lm_head`` (which makes logits meta)."""
    from llmcompressor.utils.helpers import (
        DisableQuantization,
        disable_cache,
        disable_hf_kernels,
        eval_context,
        use_eager_attention,
    )

    with contextlib.ExitStack() as stack:
        for ctx in (torch.no_grad(), disable_cache(model), eval_context(model), disable_hf_kernels(model),
                    use_eager_attention(model), DisableQuantization(model)):  # fmt: skip
            stack.enter_context(ctx)
        yield


def peer_run(model: torch.nn.Module, subgraphs: list[Any], inputs: dict[str, Any]) -> Any:
    """Chain the subgraphs through an IntermediatesCache as SequentialPipeline does.

    Returns:
        The last subgraph's return value: ``{}`` for most models, whose traced graph has no output
        node (the HF-derived tracer erases nodes that use concrete-argument placeholders).
    """
    from llmcompressor.pipelines.cache import IntermediatesCache

    cpu = torch.device("cpu")
    with calibration_settings(model):
        cache = IntermediatesCache.from_dataloader([inputs], cpu, cpu)
        output: Any = None
        for index, subgraph in enumerate(subgraphs):
            output = subgraph.forward(model, **cache.fetch(0, subgraph.input_names))
            if index < len(subgraphs) - 1:
                cache.update(0, output)
                cache.delete(0, subgraph.consumed_names)
    return output


def main() -> int:
    """Evaluate one architecture with llm-compressor and print the result marker line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="ARCH", required=True)
    arch = parser.parse_args().worker
    adapter = Adapter(
        tool="peer",
        trace=lambda model, sample: peer_trace(model, sample, arch),
        run=peer_run,
        reference=calibration_settings,
        setup_errors_are_na=True,
    )
    worker_main(arch, adapter)
    return 0


if __name__ == "__main__":
    sys.exit(main())
