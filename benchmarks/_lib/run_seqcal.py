"""One seqcal oneshot run on the shared calibration tokens (run by gptq_smollm2.py in a subprocess)."""

from __future__ import annotations

import argparse
import time

from safetensors.torch import load_file
from scheme import SCHEME  # benchmarks/_lib is on sys.path: the runners are run as scripts

from seqcal.entrypoint import oneshot
from seqcal.modifiers import AWQModifier, GPTQModifier, QuantizationModifier


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--algo", choices=["gptq", "rtn", "awq"], default="gptq")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compute-dtype", default=None)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--hessian-products", default="float32")
    parser.add_argument(
        "--recipe", default=None, help="a recipe file (instead of --algo with the shared scheme)"
    )
    parser.add_argument("--layer-cut", action="store_true", help="one_pass=False: cut after each layer")
    parser.add_argument("--samples", type=int, default=None, help="use only the first N samples")
    parser.add_argument("--n-grid", type=int, default=20, help="AWQ's grid points")
    parser.add_argument("--screen-keep", default=None,
                        help="AWQ's screen_keep (an integer, or none: every grid point on every batch)")  # fmt: skip
    parser.add_argument("--batch-size", default=None,
                        help="samples per subgraph run (equal lengths), or auto; default seqcal's own (auto on CUDA, 1 on the CPU)")  # fmt: skip
    parser.add_argument("--eager-columns", action="store_true", help="GPTQ's column loop without CUDA graphs")
    parser.add_argument(
        "--offload", default="cpu", help="the activation cache's tier (cpu, disk, device, cuda:N)"
    )
    parser.add_argument("--copies-on-compute", action="store_true",
                        help="the activation cache's copies on the compute stream (no side streams, no prefetch)")  # fmt: skip
    parser.add_argument("--pinned-register-threads", type=int, default=None,
                        help="pin new host memory with cudaHostRegister, pages touched by N threads (torch's "
                        "pinned_use_cuda_host_register / pinned_num_register_threads allocator settings)")  # fmt: skip
    parser.add_argument("--synchronous-save", action="store_true",
                        help="write each subgraph's checkpoint files before the next one starts (no worker thread)")  # fmt: skip
    args = parser.parse_args()
    if args.synchronous_save:
        import seqcal.checkpoint.streaming

        seqcal.checkpoint.streaming.BACKGROUND = False
    if args.eager_columns:
        import seqcal.backend.cuda_graphs

        seqcal.backend.cuda_graphs.CUDA_GRAPHS = False
    if args.copies_on_compute:
        import seqcal.execution.cache.store

        seqcal.execution.cache.store.OVERLAP = False
    if args.pinned_register_threads:
        import torch

        settings = (
            f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{args.pinned_register_threads}"
        )
        setter = getattr(
            torch._C, "_accelerator_setAllocatorSettings", None
        )  # torch >= 2.9; before, the cuda one
        (setter or torch.cuda.memory._set_allocator_settings)(settings)
    tokens = load_file(args.tokens)["input_ids"][: args.samples]
    data = [{"input_ids": row.tolist()} for row in tokens]
    extra = {"hessian_products": args.hessian_products} if args.algo == "gptq" else {}
    extra = {"n_grid": args.n_grid} if args.algo == "awq" else extra
    if args.algo == "awq" and args.screen_keep is not None:
        extra["screen_keep"] = None if args.screen_keep == "none" else int(args.screen_keep)
    cls = {"gptq": GPTQModifier, "rtn": QuantizationModifier, "awq": AWQModifier}[args.algo]
    start = time.perf_counter()
    recipe = args.recipe or cls(config_groups=SCHEME, ignore=["lm_head"], **extra)
    oneshot(model=args.model, dataset=data, recipe=recipe,
            output_dir=args.out, num_calibration_samples=len(data), max_seq_length=tokens.shape[1],
            dtype=args.dtype, compute_dtype=args.compute_dtype, shuffle_calibration_samples=False,
            overwrite=True, one_pass=not args.layer_cut, profile=args.profile, offload=args.offload, batch_size=args.batch_size if args.batch_size in (None, "auto") else int(args.batch_size))  # fmt: skip
    print(f"seconds {time.perf_counter() - start:.1f}")


if __name__ == "__main__":
    main()
