"""seqcal model-free: a data-free scheme applied to a safetensors checkpoint without loading the model.

    seqcal model-free --model Kimi-K2 --output-dir kimi-w4a16 --scheme W4A16 --ignore lm_head \\
        're:.*mlp.gate$' --max-workers 8 --max-host-memory 64GB

The options are ``model_free_ptq``'s keywords (``seqcal.modelfree``); ``--resume`` continues a killed run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

_SCHEME = "preset: W4A16, W8A16, FP8_DYNAMIC, FP8_BLOCK, NVFP4A16, MXFP4A16 (weights rounded to nearest)"
_CONFIG = "a JSON or YAML file with a compressed-tensors quantization config (config_groups, ignore) instead of --scheme"


def add_model_free(sub: Any) -> None:
    """Register ``seqcal model-free`` on the subcommand parsers ``sub``."""
    mf = sub.add_parser("model-free", help="quantize a safetensors checkpoint without loading the model "
                        "(data-free schemes, shard by shard)")  # fmt: skip
    mf.add_argument(
        "--model", required=True, help="checkpoint directory (safetensors), or a downloaded Hub id"
    )
    mf.add_argument("--output-dir", required=True, help="where to write the compressed-tensors checkpoint")
    mf.add_argument("--scheme", default=None, help=_SCHEME)
    mf.add_argument("--config", default=None, metavar="FILE", help=_CONFIG)
    mf.add_argument(
        "--targets", nargs="+", default=["Linear"], help="class names or re: patterns (default Linear)"
    )
    mf.add_argument("--ignore", nargs="+", default=[], help="modules kept in full precision, e.g. lm_head")
    mf.add_argument(
        "--max-workers", type=int, default=1, help="worker processes, one source file each at a time"
    )
    mf.add_argument("--max-host-memory", default=None,
                    help="e.g. 64GB: resident memory of all processes to stay under (fewer workers, or refused)")  # fmt: skip
    mf.add_argument("--threads", type=int, default=None, metavar="N",
                    help="torch threads, shared by the workers (default: the cores the load average leaves free)")  # fmt: skip
    mf.add_argument("--device", default=None, help="where weights are quantized: cpu (default) or cuda:N")
    mf.add_argument("--resume", action="store_true", help="continue a killed run in --output-dir")
    mf.add_argument("--overwrite", action="store_true", help="replace what --output-dir holds")
    mf.add_argument("--requantize", action="store_true",
                    help="quantize an FP8 source to 8 bits again (the roundings' errors compound)")  # fmt: skip
    mf.add_argument("--keep-source-format", action="store_true",
                    help="write an FP8 source's Linears the scheme leaves alone in their FP8 form, not dequantized")  # fmt: skip
    mf.add_argument("--trust-remote-code", action="store_true",
                    help="let transformers build the checkpoint's own class (only to read its modules)")  # fmt: skip
    mf.set_defaults(func=cmd_model_free)


def cmd_model_free(args: argparse.Namespace) -> int:
    from seqcal.errors import UsageError
    from seqcal.modelfree import model_free_ptq

    if (args.scheme is None) == (args.config is None):
        raise UsageError("model-free: give exactly one of --scheme (e.g. W4A16) or --config FILE")
    start = time.perf_counter()
    out = model_free_ptq(
        args.model, args.output_dir, scheme=args.scheme, config=_read_config(args.config), ignore=args.ignore,
        max_workers=args.max_workers, device=args.device, targets=args.targets,
        max_host_memory=args.max_host_memory, resume=args.resume, overwrite=args.overwrite,
        trust_remote_code=args.trust_remote_code, requantize=args.requantize,
        keep_source_format=args.keep_source_format,
    )  # fmt: skip
    print(f"model-free took {time.perf_counter() - start:.1f} s; checkpoint: {out}")
    return 0


def _read_config(path: str | None) -> dict | None:
    """The quantization config in ``path`` (JSON or YAML; a config.json's ``quantization_config`` too)."""
    if path is None:
        return None
    from pathlib import Path

    import yaml

    from seqcal.errors import UsageError

    file = Path(path)
    if not file.is_file():
        raise UsageError(
            f"model-free: --config {path} is not a file; give a JSON or YAML quantization config"
        )
    data = yaml.safe_load(file.read_text(encoding="utf-8"))  # JSON is YAML
    if isinstance(data, dict) and isinstance(data.get("quantization_config"), dict):
        data = data["quantization_config"]
    if not isinstance(data, dict) or "config_groups" not in data:
        raise UsageError(
            f"model-free: --config {path} has no config_groups; give a compressed-tensors quantization config"
        )
    return data
