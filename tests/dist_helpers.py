"""Running oneshot in several processes, as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

The ranks are forked from the test process (torch and transformers are imported already, so a rank starts
in well under a second) and each runs ``oneshot`` with one intra-op thread, as the guarantee asks.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from seqcal.entrypoint import oneshot

TIMEOUT = 240.0  # seconds a whole multi-process run may take in a test


def data(samples: int, length: int = 40) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (torch.randint(-3, 4, (length,), generator=g).cumsum(0) % 256).tolist()}
            for _ in range(samples)]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, kwargs: dict, errors: Path, setup: Callable | None) -> None:
    os.environ.update(SEQCAL_DIST_TIMEOUT=os.environ.get("SEQCAL_DIST_TIMEOUT", "60"))
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    code = 0
    try:
        if setup is not None:
            setup(rank)
        oneshot(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the test through the file
        (errors / f"rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        code = 1
    os._exit(code)  # no pytest teardown in the child


def start(world: int, kwargs: list[dict], errors: Path, setup: Callable | None = None) -> list[Any]:
    """Fork ``world`` ranks, rank r running ``oneshot(**kwargs[r])``; a rank's error goes to errors/rank{r}.txt."""
    errors.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, kwargs[r], errors, setup)) for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs


def wait_all(procs: list[Any], timeout: float = TIMEOUT) -> list[int]:
    """Exit codes of the ranks; any still running past ``timeout`` is killed (and the test fails)."""
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    assert not hung, f"{len(hung)} ranks still ran after {timeout} s"
    return [p.exitcode for p in procs]


def run(world: int, errors: Path, setup: Callable | None = None, **kwargs: Any) -> None:
    """Every rank runs ``oneshot(**kwargs)``; fails the test with the ranks' errors when one fails."""
    codes = wait_all(start(world, [kwargs] * world, errors, setup))
    if any(codes):
        raise AssertionError("\n".join(f.read_text() for f in sorted(errors.glob("rank*.txt"))))


def tensor_hashes(folder: Path) -> dict[str, str]:
    """SHA-256 of every tensor of a checkpoint's safetensors files, by name."""
    hashes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                raw = f.get_tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                hashes[name] = hashlib.sha256(raw).hexdigest()
    return hashes


def env_for_cli() -> dict[str, str]:
    """The environment of a ``seqcal`` command in a subprocess: this checkout first, one thread per process."""
    src = str(Path(__file__).parent.parent / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return {
        **env,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": "1",
        "SEQCAL_DIST_TIMEOUT": "120",
    }


class Stopped(Exception):
    """Raised where a crash would stop a run (``stopped_after``)."""


def stopped_after(monkeypatch: Any, subgraphs: int, **kwargs: Any) -> None:
    """Run ``oneshot(**kwargs)`` with progress recorded after every subgraph, stopped (as a crash would) once
    ``subgraphs`` of them are on disk; the patches are undone before it returns."""
    import seqcal.checkpoint.streaming as streaming

    calls: list[object] = []
    done = streaming.StreamingCheckpoint.done

    def stops(self: Any, sg: object) -> None:
        done(self, sg)
        calls.append(sg)
        if len(calls) == subgraphs:
            raise Stopped

    with monkeypatch.context() as patch:
        patch.setattr(streaming, "CHECKPOINT_BYTES", 1)
        patch.setattr(streaming.StreamingCheckpoint, "done", stops)
        try:
            oneshot(**kwargs)
        except Stopped:
            return
    raise AssertionError(f"the run finished before {subgraphs} subgraphs were on disk")
