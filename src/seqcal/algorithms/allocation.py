"""Bits per module under a budget, chosen one module at a time as a sequential pass reaches them.

The problem: units ``i`` (a Linear, or the Linears a serving engine fuses into one weight) each take one of
the candidate formats ``c``, at a cost ``b[i, c]`` in stored bits (codes, scales and zero points) known before
the run from the shapes alone, and an error ``e[i, c]`` known only when the pass reaches the unit (its inputs
are the quantized model's). Minimise ``sum_i e[i, c_i]`` subject to ``sum_i b[i, c_i] <= B``.

Offline, the Lagrangian relaxation ``min_c e[i, c] + lam * b[i, c]`` with the smallest ``lam`` that fits the
budget is the classic answer (Shoham and Gersho, 1988). Online, unit ``i`` is decided before the errors of the
units after it are known, so :class:`OnlineAllocation` predicts each later unit's error curve from the last
units seen in the same role (the mean, per parameter, of the same projection in the earlier layers; a role not
seen yet takes the current unit's curve), scaled to the later unit's size, solves the relaxation over the current
unit's measured curve and the later units' predicted ones with the budget that remains, and takes the current
unit's choice from it. What a choice leaves unspent (or overspends against the prediction) moves ``lam`` for
the units after it, so the budget is tracked as the pass goes.

Guarantee: a unit never takes more bits than the remaining budget less the cheapest candidates of every unit
after it, so when the budget holds every unit at its cheapest candidate (checked before the run,
:meth:`OnlineAllocation.__init__`), the total never exceeds it, whatever the errors turn out to be.

Example:
    >>> a = OnlineAllocation([Unit("l0.q", "q", 10, [20.0, 40.0]), Unit("l1.q", "q", 10, [20.0, 40.0])], 60.0)
    >>> a.choose("l0.q", [5.0, 1.0]), a.choose("l1.q", [5.0, 1.0])
    (1, 0)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def role_of(name: str) -> str:
    """The role of a unit: its name with layer and expert indices dropped (``layers.3.mlp.down_proj`` ->
    ``layers.#.mlp.down_proj``), so that the same projection of every layer shares one."""
    return _LAYER_INDEX.sub(".#", name)


@dataclass(frozen=True)
class Unit:
    """One allocation unit: modules that take one format together.

    Attributes:
        key: its name (the modules' names joined).
        role: what its error curve is predicted from (:func:`role_of`).
        params: weights it holds.
        bits: stored bits of the unit under each candidate, ``inf`` where a candidate cannot hold it.
    """

    key: str
    role: str
    params: int
    bits: list[float]


@dataclass(frozen=True)
class Choice:
    """What :meth:`OnlineAllocation.choose` decided for a unit, for the report.

    Attributes:
        index: the candidate taken; lam: the multiplier it was taken at; cap: the most bits it could take.
    """

    index: int
    lam: float
    cap: float


class OnlineAllocation:
    """Choose each unit's candidate as its error curve arrives, within a total bit budget (module docstring)."""

    def __init__(self, units: list[Unit], budget: float) -> None:
        """Args:
            units: every unit to be allocated, in any order.
            budget: total stored bits the units may take.

        Raises:
            ValueError: the budget is below every unit at its cheapest candidate.
        """
        self.units = {u.key: u for u in units}
        self.pending = dict.fromkeys(self.units)
        self.remaining = float(budget)
        self.curves: dict[str, list[list[float]]] = {}  # role -> error per parameter of each unit seen
        self.choices: dict[str, Choice] = {}
        if self.floor(self.units) > budget * (1 + 1e-12):
            raise ValueError(
                f"budget {budget:.6g} bits is below the cheapest allocation ({self.floor(self.units):.6g})"
            )

    def floor(self, keys: object) -> float:
        """Bits of ``keys`` (unit keys) at their cheapest candidates."""
        return sum(min(self.units[k].bits) for k in keys)  # type: ignore[union-attr]

    def choose(self, key: str, errors: list[float]) -> int:
        """The candidate of unit ``key`` given its measured ``errors`` (one per candidate; ``inf`` refuses one).

        Args:
            key: a unit not chosen yet.
            errors: its error under each candidate, in the units' common measure (e.g. parameters times the
                relative output error).

        Returns:
            The index of the candidate taken; its bits are spent from the budget.
        """
        unit = self.units[key]
        del self.pending[key]
        per_param = [e / max(unit.params, 1) for e in errors]
        self.curves.setdefault(unit.role, []).append(per_param)
        cap = self.remaining - self.floor(self.pending)
        bits = [b if b <= cap * (1 + 1e-12) else math.inf for b in unit.bits]
        if all(math.isinf(b) for b in bits):  # only when the budget was short from the start
            raise RuntimeError(f"allocation of {key}: no candidate fits the {cap:.6g} bits left")
        later = list(self.pending)
        E = [list(errors)] + [self._predicted(k, per_param) for k in later]
        B = [bits] + [self.units[k].bits for k in later]
        lam = _multiplier(E, B, self.remaining)
        index = _first_row(E, B, _picks(E, B, lam), self.remaining)
        self.remaining -= unit.bits[index]
        self.choices[key] = Choice(index, lam, cap)
        return index

    def _predicted(self, key: str, fallback: list[float]) -> list[float]:
        """A later unit's curve: the mean per parameter of the units of its role seen so far (the current unit's
        when none), times its size."""
        unit = self.units[key]
        seen = self.curves.get(unit.role, [fallback])
        return [sum(column) / len(seen) * unit.params for column in zip(*seen)]


# Plain Python over lists: a few hundred units times a few candidates, where a tensor op's fixed cost (and its
# thread pool, on a loaded machine) would dominate.
Rows = list[list[float]]


def _picks(E: Rows, B: Rows, lam: float) -> list[int]:
    """Each row's ``argmin_c E + lam * B`` over its finite candidates, ties to the fewer bits."""
    out = []
    for e, b in zip(E, B):
        cost = [
            ei + lam * bi if math.isfinite(bi) and math.isfinite(ei) else math.inf for ei, bi in zip(e, b)
        ]
        best = min(cost)
        tied = [c for c, x in enumerate(cost) if x <= best + 1e-12 * max(abs(best), 1e-300)]
        out.append(min(tied, key=lambda c: b[c]))
    return out


def _total(E: Rows, B: Rows, lam: float) -> float:
    return sum(b[c] for b, c in zip(B, _picks(E, B, lam)))


def _multiplier(E: Rows, B: Rows, budget: float) -> float:
    """The smallest ``lam >= 0`` whose picks fit ``budget`` (bisection in log space; the total is
    non-increasing in ``lam``); a ``lam`` so large that every row takes its cheapest candidate when none fits."""
    if _total(E, B, 0.0) <= budget:
        return 0.0
    errors = [abs(x) for e in E for x in e if math.isfinite(x)]
    bits = [x for b in B for x in b if math.isfinite(x)]
    hi = max(max(errors, default=1.0), 1e-30) / max(min(bits, default=1.0), 1e-30)
    while _total(E, B, hi) > budget and hi < 1e300:
        hi *= 16
    lo = hi * 1e-30
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if _total(E, B, mid) <= budget else (mid, hi)
    return hi


def _first_row(E: Rows, B: Rows, picks: list[int], budget: float) -> int:
    """Row 0's candidate in the relaxation's solution with the budget ``lam``'s picks leave filled.

    At the smallest ``lam`` that fits, rows whose next candidate costs exactly ``lam`` per bit are tied; the
    relaxation takes the upgrade for a fraction of them (the budget left over), which picks alone would give
    to none, leaving the slack to the last units of the pass. So: each row's best upgrade (error saved per
    bit added), groups of equal value filled in order of value while they fit, the first group that does not
    fit filled in part; row 0 takes its upgrade when its group is filled, or filled at least half.
    """
    slack = budget - sum(b[c] for b, c in zip(B, picks))
    upgrades = []  # (error saved per added bit, row, candidate, added bits)
    for row, (e, b, c) in enumerate(zip(E, B, picks)):
        options = [((e[c] - e[k]) / (b[k] - b[c]), k) for k in range(len(b))
                   if math.isfinite(b[k]) and math.isfinite(e[k]) and b[k] > b[c] and e[k] < e[c]]  # fmt: skip
        if options:
            value, k = max(options)
            upgrades.append((value, row, k, b[k] - b[c]))
    mine = next((u for u in upgrades if u[1] == 0), None)
    if mine is None:
        return picks[0]
    levels: list[float] = []  # distinct values, largest first (equal within a relative 1e-9)
    for v in sorted((u[0] for u in upgrades), reverse=True):
        if not levels or v < levels[-1] * (1 - 1e-9):
            levels.append(v)
    for v in levels:
        group = [u for u in upgrades if v * (1 - 1e-9) <= u[0] <= v * (1 + 1e-9)]
        need = sum(u[3] for u in group)
        if mine in group:
            return mine[2] if slack >= need / 2 else picks[0]
        if need > slack:
            return picks[0]
        slack -= need
    return picks[0]
