"""What a memory plan holds: the predicted bytes of each subgraph (``SubgraphPlan``) and of the whole run
(``MemoryPlan``: its peaks, the settings it chose, its table). ``seqcal.plan.plan_memory`` fills them.

Example:
    >>> row = SubgraphPlan(0, ["model.layers.0"], weights=10, hessians=4, activations=3, host_cache=0, solve=5)
    >>> row.device_peak  # weights + Hessians + the larger of the calibration pass and the solve
    19
"""

from __future__ import annotations

from dataclasses import dataclass, field

from seqcal.plan.values import PROCESS_BASELINE


@dataclass
class SubgraphPlan:
    """Predicted memory of one subgraph (bytes); ``host`` is the process's resident memory while it runs."""

    index: int
    targets: list[str]
    weights: int
    hessians: int
    activations: int
    host_cache: int
    solve: int = 0
    host: int = 0
    chunks: int = 1  # stacked solves of its largest group of modules sharing a Hessian (solve_chunks)
    chunk_bytes: int = 0  # the most working bytes one of them may take
    quantized_numel: int = 0  # weights it quantizes (their codes and scales are sent to other processes)
    solve_cost: float = 0.0  # sum of out * in^2 + in^3 over them, as seqcal.distributed assigns solves
    device_cache: int = 0  # the activation cache on the execution device (offload="device" on a GPU)
    # host = the plan's baseline + HEAP_SLACK + resident + cache_ram + work + held: what a host budget weighs
    resident: int = 0  # weights that stay in RAM all along
    cache_ram: int = 0  # the activation cache in RAM while it runs
    work: int = 0  # its own work in RAM: the device share on a cpu run (weights, Hessians, solve) or its save
    held: int = 0  # the previous subgraph's save, written by the worker thread meanwhile
    # while it calibrates: one virtual shard's Hessians beside the fold of those before (seqcal.distributed), and on
    # the cpu MKL's buffers for the Hessian update (GEMM_BUFFERS)
    accumulators: int = 0

    @property
    def device_peak(self) -> int:
        calibration = self.activations + self.accumulators
        return self.weights + self.hessians + max(calibration, self.solve) + self.device_cache


@dataclass
class MemoryPlan:
    """Predicted memory per subgraph and for the whole run (bytes)."""

    rows: list[SubgraphPlan]
    host_peak: int
    disk: int
    notes: list[str] = field(default_factory=list)
    targets: list[str] | None = None  # the sequential targets the plan settled on
    batch_size: int = 1  # samples per batch the plan is for (batch_size="auto": the size it chose)
    dtype_bytes: int = 4  # bytes per weight element of the model
    one_pass: bool = False  # the cut: before each group of quantized modules (True) or after each target
    baseline: int = PROCESS_BASELINE  # the process's own resident memory, in every row's host
    in_place_factor: bool = False  # GPTQ's cpu factor in the Hessian's own memory (gptq_factor.factor_bytes)
    background_save: bool = True  # each subgraph's save written while the next runs (streaming.BACKGROUND)

    @property
    def device_peak(self) -> int:
        return max(r.device_peak for r in self.rows) if self.rows else 0

    def limit_cache(self, limit: int) -> None:
        """Hold at most ``limit`` bytes of the activation cache in RAM (``cache_max_memory``): the rest on disk."""
        spilled = 0
        for r in self.rows:
            kept = min(r.cache_ram, limit)
            spilled, r.host = max(spilled, r.cache_ram - kept), r.host - r.cache_ram + kept
            r.cache_ram, r.host_cache = kept, min(r.host_cache, limit)
        self.host_peak = max((r.host for r in self.rows), default=self.baseline)
        self.disk += spilled

    def table(self) -> str:
        gb = 1024**3
        cols = ("weights", "hessians", "activ.", "solve", "device", "cache", "host")
        lines = [f"{'#':>3}  {'target':<28} " + " ".join(f"{c:>9}" for c in cols) + f" {'chunks':>11}"]
        for r in self.rows:
            target = (r.targets[0] if r.targets else "-")[:28]
            cache = r.host_cache + r.device_cache  # wherever the cache is held in memory
            values = (r.weights, r.hessians, r.activations, r.solve, r.device_peak, cache, r.host)
            chunks = f"{r.chunks}x{r.chunk_bytes / 2**20:.0f}M" if r.chunks > 1 else "1"
            lines.append(f"{r.index:>3}  {target:<28} " + " ".join(f"{v / gb:>8.3f}G" for v in values)
                         + f" {chunks:>11}")  # fmt: skip
        lines.append(
            f"peak: device {self.device_peak / gb:.3f} GB, host {self.host_peak / gb:.3f} GB, "
            f"disk {self.disk / gb:.3f} GB; batch size {self.batch_size}"
        )
        return "\n".join(lines + [f"note: {n}" for n in self.notes])
