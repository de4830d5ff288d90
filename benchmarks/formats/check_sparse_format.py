"""Check seqcal's sparse-24-bitmask / sparse-bitmask tensors against compressed-tensors' own compressors.

compressed-tensors removed its sparse compressors after 0.14, so the check runs an older release (one that
still has ``compressors/sparse_compressors``, e.g. 0.10.2 unpacked into a folder) in a subprocess, on weights
that seqcal writes (2:4 and unstructured; float32, bfloat16, fp8 and int8), and compares every tensor bit for bit.

Usage:
    pip download compressed-tensors==0.10.2 --no-deps -d /tmp/ct && unzip -q /tmp/ct/*.whl -d /tmp/ct/src
    .venv/bin/python benchmarks/formats/check_sparse_format.py --old-ct /tmp/ct/src
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from seqcal.algorithms.sparsity import lowest_mask, nm_mask
from seqcal.checkpoint.sparse import bitmask_compress

OLD = """
import sys
from safetensors.torch import load_file, save_file
from compressed_tensors.compressors.sparse_compressors.sparse_24_bitmask import Sparse24BitMaskTensor
from compressed_tensors.compressors.sparse_compressors.sparse_bitmask import BitmaskTensor
dense, out = load_file(sys.argv[1]), {}
for key, W in dense.items():
    cls = Sparse24BitMaskTensor if key.startswith("24") else BitmaskTensor
    out.update(cls.from_dense(W).dict(name_prefix=key, device="cpu"))
save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[2])
"""


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    W = torch.randn(64, 128, generator=g)
    structured, unstructured = (
        W.masked_fill(nm_mask(W.abs(), 2, 4), 0),
        W.masked_fill(lowest_mask(W.abs(), 4096), 0),
    )
    out = {}
    for tag, dense in (("24", structured), ("un", unstructured)):
        out[f"{tag}.f32"], out[f"{tag}.bf16"] = dense, dense.bfloat16()
        out[f"{tag}.fp8"] = dense.to(torch.float8_e4m3fn)
        out[f"{tag}.int8"] = (dense * 40).round().clamp(-127, 127).to(torch.int8)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--old-ct", required=True, help="folder holding an older compressed_tensors package")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dense_path, theirs_path = Path(tmp) / "dense.safetensors", Path(tmp) / "theirs.safetensors"
        dense = weights()
        save_file(dense, str(dense_path))
        env = {**os.environ, "PYTHONPATH": args.old_ct}
        subprocess.run([sys.executable, "-c", OLD, str(dense_path), str(theirs_path)], env=env, check=True)
        theirs = load_file(str(theirs_path))
    mismatched = []
    for key, W in dense.items():
        fmt = "sparse-24-bitmask" if key.startswith("24") else "sparse-bitmask"
        for local, ours in bitmask_compress(W, fmt).items():
            ref = theirs[f"{key}.{local}"]
            same = (
                ours.dtype == ref.dtype
                and ours.shape == ref.shape
                and torch.equal(ours.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8))
            )
            if not same:
                mismatched.append(
                    f"{key}.{local}: ours {ours.dtype} {list(ours.shape)}, theirs {ref.dtype} {list(ref.shape)}"
                )
    print(f"{len(dense)} weights, {sum(1 for k in theirs)} tensors compared; mismatches: {len(mismatched)}")
    for line in mismatched:
        print("  ", line)
    raise SystemExit(1 if mismatched else 0)


if __name__ == "__main__":
    main()
