"""seqcal's GGUF scales with an importance matrix against ``llama-quantize --imatrix``'s, block by block.

Reads the f32 file, the importance matrix and llama.cpp's Q4_K_M file that ``gguf_llamacpp.py`` made (rows ``f32``
and ``llama-Q4_K_M-imatrix``, its ``imatrix_128x512.gguf``), computes each tensor's scales with
``seqcal.gguf.grids.qparams(W, fmt, importance)`` (importance: the matrix's sums over its counts, as
llama-quantize reads it), packs them and prints, per GGUF type, the share of blocks whose scale bytes equal
llama.cpp's, with the same share for the rule without an importance matrix beside it. The codes are not compared:
llama.cpp's Q5_0 keeps the codes its search found with the unrounded scale, where seqcal rounds with the stored one.

Usage (from the repo root, after ``gguf_llamacpp.py --runs f32,llama-Q4_K_M-imatrix``):
    .venv/bin/python benchmarks/formats/gguf_imatrix_scales.py [--types Q4_K,Q6_K,Q5_0]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
from harness import WORK  # noqa: E402

from seqcal.gguf.grids import gguf_format, qparams, quantize  # noqa: E402
from seqcal.gguf.pack import pack  # noqa: E402

OUT = WORK / "gguf"
# where each type keeps its block scales in a block's bytes (ggml's block_q5_0 / block_q4_K / block_q6_K)
SCALE_BYTES = {"Q5_0": slice(0, 2), "Q4_K": slice(0, 16), "Q5_K": slice(0, 16), "Q6_K": slice(192, 210)}


def importance_of(matrix: dict, name: str) -> torch.Tensor | None:
    sums, counts = matrix.get(name + ".in_sum2"), matrix.get(name + ".counts")
    if sums is None or counts is None:
        return None
    count = float(np.asarray(counts.data).reshape(-1)[0])
    return torch.from_numpy(np.asarray(sums.data, dtype=np.float32).reshape(-1).copy()) / count


def equal_blocks(W: torch.Tensor, kind: str, importance: torch.Tensor | None, theirs: np.ndarray) -> np.ndarray:
    """Per block, whether seqcal's scale bytes for ``W`` equal ``theirs``'s."""
    fmt = gguf_format(kind)
    scale, zero = qparams(W, fmt, importance)
    ours = pack(quantize(W, scale, zero, fmt), scale, zero, fmt)
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    where = SCALE_BYTES[kind]
    a = ours.reshape(ours.shape[0], -1, size)[..., where]
    b = theirs.reshape(ours.shape[0], -1, size)[..., where]
    return (a == b).all(-1).reshape(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="Q4_K,Q6_K,Q5_0")
    args = parser.parse_args()
    kinds = args.types.split(",")
    source = {t.name: t for t in gguf.GGUFReader(OUT / "f32" / "model.gguf").tensors}
    matrix = {t.name: t for t in gguf.GGUFReader(OUT / "imatrix_128x512.gguf").tensors}
    weighted, plain = defaultdict(list), defaultdict(list)
    for t in gguf.GGUFReader(OUT / "llama-Q4_K_M-imatrix" / "model.gguf").tensors:
        kind = t.tensor_type.name
        importance = importance_of(matrix, t.name)
        if kind not in kinds or importance is None:
            continue
        W = torch.from_numpy(np.asarray(source[t.name].data, dtype=np.float32).copy()).reshape(-1, importance.numel())
        theirs = np.asarray(t.data)
        weighted[kind].append(equal_blocks(W, kind, importance, theirs))
        plain[kind].append(equal_blocks(W, kind, None, theirs))
    print("| type | tensors | blocks | scale bytes equal to llama-quantize --imatrix's | the same, rule without |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        if weighted[kind]:
            w, p = np.concatenate(weighted[kind]), np.concatenate(plain[kind])
            print(f"| {kind} | {len(weighted[kind])} | {w.size} | {w.mean():.4f} | {p.mean():.4f} |")


if __name__ == "__main__":
    main()
