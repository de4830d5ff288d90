"""The output directory of a model-free run: refused when it holds something else, resumed file by file.

An output file exists under its final name only once complete (``worker.run_job`` renames it), so the files a
killed run finished are the ones there; ``seqcal_progress.json`` records what the run was (the source's headers,
the quantization config, the versions that decide the bytes), and a resumed run with other arguments is refused
rather than mixing two checkpoints. ``config.json`` is written last: its presence means finished.

Example:
    >>> done = prepare_output("out", identity, overwrite=False, resume=True)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import compressed_tensors
import torch

from seqcal.checkpoint.preflight import check_output_dir
from seqcal.checkpoint.streaming import ResumeError
from seqcal.checkpoint.writer import CONFIG_NAME, INDEX_NAME, PROGRESS_NAME, _write_json
from seqcal.modelfree.source import SourceCheckpoint
from seqcal.modelfree.worker import PARTIAL

KIND = "model-free"


def run_identity(source: SourceCheckpoint, block: dict[str, Any]) -> dict[str, Any]:
    """What the output's bytes depend on: the source's tensors (names, dtypes, shapes, files: a hash of the
    headers; the data itself would take a read of the whole checkpoint) and sizes, the quantization config, and
    the versions of the code that computes them."""
    headers = json.dumps({k: [v.file, v.dtype, list(v.shape)] for k, v in sorted(source.info.items())})
    return {
        "kind": KIND,
        "source": str(source.path.resolve()),
        "files": {f: (source.path / f).stat().st_size for f in source.files},
        "headers_sha256": hashlib.sha256(headers.encode()).hexdigest(),
        "quantization_config": block,
        "versions": {"torch": torch.__version__, "compressed-tensors": compressed_tensors.__version__},
    }


def prepare_output(path: str | Path, identity: dict[str, Any], *, overwrite: bool, resume: bool) -> set[str]:
    """Make ``path`` ready for the run; returns the output files a killed run already finished.

    Raises:
        FileExistsError: ``path`` is not empty (and neither overwrite nor resume), or holds no seqcal run.
        ResumeError: ``resume`` but the run there was another (other source, scheme, targets or versions).
    """
    out = Path(path)
    check_output_dir(str(out), overwrite=overwrite, resume=resume)
    record = out / PROGRESS_NAME
    if resume and record.is_file():
        earlier = json.loads(record.read_text(encoding="utf-8")).get("model_free")
        if earlier != identity:
            what = _first_difference(earlier, identity)
            raise ResumeError(
                f"model-free: {out} holds another run ({what} differs); rerun with its arguments, or pass "
                "overwrite=True (CLI: --overwrite) to start again"
            )
    elif resume and (out / CONFIG_NAME).is_file():
        raise ResumeError(
            f"model-free: {out} holds a finished checkpoint, there is nothing to resume; choose another output "
            "directory, or pass overwrite=True (CLI: --overwrite) to write it again"
        )
    elif overwrite and out.is_dir():
        (out / CONFIG_NAME).unlink(missing_ok=True)  # first: the directory no longer looks finished
        for stale in [*out.glob("*.safetensors"), *out.glob(f"*{PARTIAL}"), out / INDEX_NAME, record]:
            stale.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    for stray in out.glob(f"*{PARTIAL}"):  # a file a killed run was writing: written again
        stray.unlink()
    _write_json(record, {"model_free": identity})
    return {p.name for p in out.glob("*.safetensors")}


def _first_difference(earlier: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """The first field of the run's identity that differs (for the message)."""
    if not isinstance(earlier, dict):
        return "the kind of run (not a model-free run)"
    return next((k for k in now if earlier.get(k) != now[k]), "the record")
