"""Running oneshot in several processes, as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)  # the same threads per process in every run (the guarantee needs it)
from seqcal.entrypoint import oneshot
args = json.loads(sys.argv[1])
g = torch.Generator().manual_seed(1)
data = [{"input_ids": (torch.randint(-3, 4, (args.pop("length", 48),), generator=g).cumsum(0) % 256).tolist()}
        for _ in range(args.pop("samples"))]
oneshot(dataset=data, **args)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """The environment torchrun gives a rank, with this checkout's seqcal first on the path."""
    src = str(Path(__file__).parent.parent / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}
    if world > 1:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    return env


def start(world: int, args: list[str], **extra: str) -> list[subprocess.Popen]:
    """Start ``world`` processes running SCRIPT with the JSON ``args`` of each rank (one per rank)."""
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, args[r]],
            env=env_for(r, world, port, **extra),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(world)
    ]


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """(exit code, stderr) of each process; kills them all past ``timeout`` seconds."""
    out = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        out.append((proc.returncode, err))
    return out


def tensor_hashes(folder: Path) -> dict[str, str]:
    """SHA-256 of every tensor of a checkpoint's safetensors files, by name."""
    hashes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # the bytes, any dtype
                hashes[name] = hashlib.sha256(raw).hexdigest()
    return hashes
