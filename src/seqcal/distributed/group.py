"""The process group: launched from torchrun's environment, and the few messages ranks exchange.

Every exchange goes through ``ProcessGroup``: bytes (safetensors payloads) point to point or broadcast, and
``agree`` (each rank's verdict on a step, all gathered), so that a rank that stops or was started with other
arguments ends the run on every rank with one sentence instead of a hang or a gloo traceback.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from seqcal.errors import SeqcalError

BACKEND = "cpu:gloo,cuda:nccl"
# Seconds a rank waits for another before the run stops (SEQCAL_DIST_TIMEOUT overrides): longer than the
# slowest solve of a subgraph, since ranks wait for its owner.
DEFAULT_TIMEOUT = 1800.0
_MESSAGE_BYTES = 512  # a verdict in ``agree``: utf-8, cut to this length


class DistributedError(SeqcalError, RuntimeError):
    """Another process of the run failed, disagreed or stopped answering."""


def _timeout() -> float:
    return float(os.environ.get("SEQCAL_DIST_TIMEOUT", DEFAULT_TIMEOUT))


def _torchrun_env() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


@contextlib.contextmanager
def launched() -> Iterator[bool]:
    """Start the process group from torchrun's environment for the block, unless one is running already.

    Yields True when it started one (and destroys it on exit), False otherwise (no torchrun, or the caller
    initialised ``torch.distributed`` itself: then its group is used and left as it is).

    Example:
        >>> with launched():  # doctest: +SKIP
        ...     oneshot(...)
    """
    if dist.is_initialized() or not _torchrun_env() or int(os.environ["WORLD_SIZE"]) == 1:
        yield False
        return
    backend = BACKEND if dist.is_nccl_available() else "gloo"  # a CPU-only torch has no NCCL
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=_timeout()))
    try:
        yield True
    finally:
        dist.destroy_process_group()


@dataclass
class ProcessGroup:
    """This process's rank among ``world_size``, and the messages of a run (rank 0 writes the checkpoint).

    A single process is a group of one: every method then works without ``torch.distributed``.
    """

    rank: int = 0
    world_size: int = 1
    comm_seconds: float = field(default=0.0)  # time spent sending, receiving and waiting
    bytes_sent: int = field(default=0)

    @property
    def writes(self) -> bool:
        """Whether this rank writes the output directory."""
        return self.rank == 0

    @contextlib.contextmanager
    def _talking(self, what: str, peer: int | str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        except (RuntimeError, ValueError) as exc:  # gloo reports a lost or timed-out peer as RuntimeError
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: {what} with rank {peer} failed ({str(exc)[:200]}); "
                f"another process stopped or did not answer within {_timeout():.0f} s (SEQCAL_DIST_TIMEOUT): "
                "see its own error, then rerun all processes with resume=True"
            ) from exc
        finally:
            self.comm_seconds += time.perf_counter() - start

    def send(self, data: bytes, dst: int, what: str) -> None:
        with self._talking(what, dst):
            dist.send(torch.tensor([len(data)], dtype=torch.int64), dst)
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)
        self.bytes_sent += len(data)

    def recv(self, src: int, what: str) -> bytes:
        with self._talking(what, src):
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, src)
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(buf, src)
        return buf.numpy().tobytes()

    def broadcast(self, data: bytes | None, src: int, what: str) -> bytes:
        """``data`` from ``src`` on every rank (others pass None)."""
        if self.world_size == 1:
            return data or b""
        with self._talking(what, src):
            size = torch.tensor(
                [len(data) if self.rank == src and data is not None else 0], dtype=torch.int64
            )
            dist.broadcast(size, src)
            if self.rank == src:
                buf = torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8)[: int(size.item())]
            else:
                buf = torch.empty(int(size.item()), dtype=torch.uint8)
            if buf.numel():
                dist.broadcast(buf, src)
        if self.rank == src:
            self.bytes_sent += len(data or b"") * (self.world_size - 1)
        return buf.numpy().tobytes()

    def agree(self, step: str, check: Callable[[], None]) -> None:
        """Run ``check`` on this rank and stop every rank if it failed on any, naming the rank and why.

        Raises:
            DistributedError: another rank's check failed (this rank's own error is raised as it is).
        """
        error: BaseException | None = None
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - whatever it is, the other ranks must hear of it, not hang
            error = exc
        if self.world_size > 1:
            message = f"{type(error).__name__}: {error}" if error is not None else ""
            verdicts = self._gather(message.encode()[:_MESSAGE_BYTES], step)
            failed = [(r, v) for r, v in enumerate(verdicts) if v]
            if failed and error is None:
                rank, verdict = failed[0]
                raise DistributedError(f"rank {rank} of {self.world_size} stopped at {step}: {verdict}")
        if error is not None:
            raise error

    def _gather(self, message: bytes, step: str) -> list[str]:
        buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        if message:
            buf[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
        out = [torch.zeros_like(buf) for _ in range(self.world_size)]
        with self._talking(step, "all"):
            dist.all_gather(out, buf)
        return [bytes(t.numpy().tobytes()).rstrip(b"\0").decode(errors="replace") for t in out]

    def check_same_run(self, parts: str) -> None:
        """Stop every rank when the ranks were started with different arguments, recipes, models or data.

        Args:
            parts: what identifies the run (``repr`` of its arguments, the data's content hash).
        """
        digest = hashlib.sha256(parts.encode()).hexdigest()[:16]
        if self.world_size == 1:
            return
        digests = self._gather(digest.encode(), "the start (comparing the runs' fingerprints)")
        if len(set(digests)) > 1:
            differing = [r for r, d in enumerate(digests) if d != digests[0]]
            raise DistributedError(
                f"rank {self.rank}: the processes were started with different arguments, recipes, models or "
                f"data, or with different numbers of threads (fingerprint of rank 0 {digests[0]}, differing on "
                f"ranks {differing}); start every rank with the same command line and OMP_NUM_THREADS"
            )


def process_group() -> ProcessGroup:
    """This process's place in the running ``torch.distributed`` group, or a group of one."""
    if dist.is_available() and dist.is_initialized():
        return ProcessGroup(dist.get_rank(), dist.get_world_size())
    return ProcessGroup()


def writer_rank() -> bool:
    """Whether this process writes the output (rank 0), also after its process group is gone (torchrun's RANK)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0 or int(os.environ.get("WORLD_SIZE", "1")) == 1


def rank_path(path: str | None) -> str | None:
    """A file each rank writes for itself (the profile): ``trace.json`` on rank 0, ``trace.rank1.json`` on rank 1."""
    if path is None or writer_rank():
        return path
    return _rank_file(path, dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0")))


def _rank_file(path: str, rank: int) -> str:
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.rank{rank}.{ext}" if dot else f"{path}.rank{rank}"


def merge_rank_profiles(path: str | None, group: ProcessGroup) -> None:
    """Put every rank's trace (``rank_path``) into rank 0's file, one process per rank (``pid`` = rank + 1,
    named "rank r"): each with its tracks, ``communication`` among them. The other files are removed.

    Every rank calls it after closing its profiler; they wait for each other first.
    """
    if path is None or group.world_size == 1:
        return
    group.agree("merging the profiles", lambda: None)  # every rank's trace is written
    if not group.writes:
        return
    import json
    from pathlib import Path

    trace = json.loads(Path(path).read_text())
    for r in range(group.world_size):
        mine = trace["traceEvents"] if r == 0 else None
        if r:
            other = Path(_rank_file(path, r))
            mine = json.loads(other.read_text())["traceEvents"]
            other.unlink()
            trace["traceEvents"].extend(mine)
        for event in mine:
            event["pid"] = r + 1
        trace["traceEvents"].append(
            {"name": "process_name", "ph": "M", "pid": r + 1, "args": {"name": f"rank {r}"}}
        )
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(trace, default=str))
    os.replace(tmp, path)
