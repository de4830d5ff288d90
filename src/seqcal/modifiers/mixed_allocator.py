"""The mixed-precision choice as a quantizer uses it: arguments, checks before calibration, the choice per unit.

``MixedPrecision`` is the ``mixed_precision`` argument of ``QuantizationModifier`` and ``GPTQModifier`` (and
``MixedPrecisionModifier``'s own arguments): it checks the arguments when the recipe is read, checks the
model before any weight is calibrated (``validate``: pins that match nothing, units no candidate holds, a
budget below the cheapest allocation), during the pass sets each module's scheme from its error curve
(``assign``, from the curves ``mixed_curves`` measures), and takes the choices another process or an interrupted
run made from the curves they recorded (``catch_up``). How and what it guarantees: ``seqcal.modifiers.mixed_precision``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import yaml
from compressed_tensors.quantization import QuantizationScheme

from seqcal.algorithms.allocation import OnlineAllocation, Unit, role_of
from seqcal.mappings.names import checkpoint_names
from seqcal.modifiers.formats import check_widths
from seqcal.modifiers.mixed_curves import InputsOf, Rounding, error_curve, output_errors, relative
from seqcal.modifiers.mixed_schemes import allocation_units, candidate_scheme, holds, stored_bits, unit_key
from seqcal.modifiers.schemes import matches_target
from seqcal.modifiers.state import RunState

logger = logging.getLogger("seqcal")

RECIPE_FILENAME = "mixed_precision_recipe.yaml"
# the report entry of a unit's first module that records its choice: {"unit", "step", "errors"} (``catch_up``)
ALLOCATION_KEY = "allocation"


@dataclass
class MixedPrecision:
    """Each module's scheme chosen from ``candidates`` under a budget (``seqcal.modifiers.mixed_precision``).

    Attributes:
        average_bits: stored bits per weight over the quantized modules; or max_size: checkpoint bytes.
        candidates: presets, ``PRESET:g<N>`` / ``PRESET:channel``, or scheme dicts; None: ``DEFAULT_CANDIDATES``,
            whose 2-bit ones (``FALLBACK``) are taken only where the budget cannot be met without them.
        pin: ``{pattern: candidate}``: modules that keep that scheme (counted in the budget).
        error: what the allocation minimises: "absolute", the sum of the modules' output errors
            ``||(Q - W) X^T||^2`` per token (the error o_proj and down_proj add to the residual stream), or
            "relative", the sum of their relative errors squared weighted by their sizes.
        targets: the modifier's targets; where: the modifier's name, for errors.
    """

    # 3 and 4 bits at groups of 128 and 64 give the allocation steps of a quarter bit; 2 bits only as a fallback:
    # a module's error curve underrates what a 2-bit module costs the model (errors that compound), and at 3.5
    # bits on SmolLM2 the same allocation with 2 bits among its choices lost to uniform 3 bits, without them it
    # won (benchmarks/RESULTS.md, "Mixed precision")
    DEFAULT_CANDIDATES: ClassVar[tuple[str, ...]] = (
        "W3A16:g128", "W3A16:g64", "W4A16:g128", "W4A16:g64", "W8A16", "W2A16:g64"
    )  # fmt: skip
    FALLBACK: ClassVar[tuple[str, ...]] = ("W2A16:g64",)
    average_bits: float | None = None
    max_size: int | str | None = None
    candidates: list[Any] | None = None
    pin: dict[str, Any] = field(default_factory=dict)
    error: str = "relative"
    targets: list[str] = field(default_factory=lambda: ["Linear"])
    where: str = "mixed_precision"

    @classmethod
    def of(cls, args: dict[str, Any] | None, targets: str | list[str], where: str) -> MixedPrecision | None:
        """The choice a modifier's ``mixed_precision`` argument describes, or None when it is None."""
        if args is None:
            return None
        if not isinstance(args, dict) or set(args) - {
            "average_bits",
            "max_size",
            "candidates",
            "pin",
            "error",
        }:
            raise ValueError(f"{where}: mixed_precision must be a mapping of average_bits or max_size, candidates "
                             f"and pin, got {args!r}")  # fmt: skip
        given = {k: v for k, v in args.items() if v is not None}
        return cls(**given, targets=[targets] if isinstance(targets, str) else list(targets), where=where)

    def __post_init__(self) -> None:
        w = self.where
        if (self.average_bits is None) == (self.max_size is None):
            raise ValueError(
                f"{w}: give exactly one budget, average_bits (e.g. 4.25) or max_size (e.g. '70MB')"
            )
        if self.average_bits is not None and (isinstance(self.average_bits, bool) or not isinstance(
                self.average_bits, (int, float)) or not self.average_bits > 0):  # fmt: skip
            raise ValueError(
                f"{w}: average_bits must be a positive number of bits per weight, got {self.average_bits!r}"
            )
        self.size = _size(self.max_size, w) if self.max_size is not None else None
        if self.error not in ("absolute", "relative"):
            raise ValueError(
                f"{w}: error={self.error!r} is not 'absolute' (output error) or 'relative' (per module)"
            )
        self.defaulted = self.candidates is None
        if self.candidates is None:
            self.candidates = list(self.DEFAULT_CANDIDATES)
        if not isinstance(self.candidates, (list, tuple)) or not self.candidates:
            raise ValueError(
                f"{w}: candidates must be a non-empty list of schemes, e.g. ['W3A16:g64', 'W4A16']"
            )
        self.schemes = [candidate_scheme(c, self.targets, w) for c in self.candidates]
        self.labels = [c if isinstance(c, str) else f"candidate_{i}" for i, c in enumerate(self.candidates)]
        if not isinstance(self.pin, dict):
            raise ValueError(
                f"{w}: pin must map module patterns to schemes, e.g. {{'re:.*down_proj': 'W8A16'}}"
            )
        self.pinned = {p: candidate_scheme(s, [p], w) for p, s in self.pin.items()}
        self.allocation: OnlineAllocation | None = None
        self.chosen: dict[str, int] = {}  # unit key -> candidate index

    def every_scheme(self) -> dict[str, QuantizationScheme]:
        """Every scheme a module may get, by name: the pins and the candidates (observer overrides reach them all)."""
        return {**{f"pin_{i}": s for i, s in enumerate(self.pinned.values())},
                **{f"candidate_{i}": s for i, s in enumerate(self.schemes)}}  # fmt: skip

    def groups(self) -> dict[str, QuantizationScheme]:
        """Config groups for ``resolve_modules``: the pins first (the first match wins), then every other
        target with the first candidate until ``assign`` sets its own."""
        return {**{f"pin_{i}": s for i, s in enumerate(self.pinned.values())}, "mixed": self.schemes[0]}

    def check_pins(self, model: torch.nn.Module) -> None:
        """Refuse a pin that matches no Linear (before the modules are resolved, whose message is about targets)."""
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        aliases = checkpoint_names(model)
        for pattern in self.pinned:
            if not any(matches_target(m, n, [pattern], aliases.get(n)) for n, m in linears):
                raise ValueError(f"{self.where}: pin {pattern!r} matches no Linear of {type(model).__name__}; give a "
                                 "module name, a class name or an 're:' pattern (matched from the start of the name)")  # fmt: skip

    def validate(self, model: torch.nn.Module, modules: dict[str, QuantizationScheme]) -> None:
        """Check the model before calibration and set up the allocation over ``modules`` (name -> scheme).

        Raises:
            ValueError: a pin matching no Linear, a fused unit pinned in part, a unit no candidate holds, or a
                budget below the cheapest allocation: one sentence each, with the fix.
        """
        w = self.where
        pinned = {n for n, s in modules.items() if s is not self.schemes[0]}
        check_widths(model, {n: modules[n] for n in pinned}, w)
        self.units: dict[str, tuple[str, ...]] = {}
        units, fixed_bits, params = [], 0.0, 0
        for members in allocation_units(model, list(modules)):
            weights = [model.get_submodule(m).weight for m in members]
            params += sum(p.numel() for p in weights)
            if any(m in pinned for m in members):
                _check_pinned(members, modules, pinned, w)
                fixed_bits += sum(_bits(modules[m], p) for m, p in zip(members, weights))
                continue
            key = unit_key(members)
            bits = [sum(_bits(s, p) for p in weights) if all(holds(model, m, s) for m in members) else math.inf
                    for s in self.schemes]  # fmt: skip
            if all(math.isinf(b) for b in bits):
                raise ValueError(f"{w}: no candidate can quantize {key} ({weights[0].shape[-1]} inputs: group sizes "
                                 "must divide them); add a candidate that does, or add it to ignore")  # fmt: skip
            self.units[key] = members
            units.append(Unit(key, role_of(key), sum(p.numel() for p in weights), bits))
        budget, total = self._budget(model, modules, params)
        units = self._without_fallback(units, budget - fixed_bits)
        try:
            self.allocation = OnlineAllocation(units, budget - fixed_bits)
        except ValueError:
            least = (fixed_bits + sum(min(u.bits) for u in units)) / max(params, 1)
            asked = f"average_bits={self.average_bits}" if self.size is None else f"max_size={self.max_size}"
            raise ValueError(f"{w}: {asked} is below the smallest allocation the candidates give "
                             f"{type(model).__name__}, {least:.3f} bits per quantized weight ({total}); raise the "
                             "budget or add a smaller candidate") from None  # fmt: skip
        self.params = params

    def _without_fallback(self, units: list[Unit], budget: float) -> list[Unit]:
        """The default candidates' 2-bit ones (``FALLBACK``) left out of every unit (their bits ``inf``) where the
        others meet ``budget`` at their cheapest; all of them where they do not, or where the user named them."""
        fallback = [i for i, c in enumerate(self.candidates) if self.defaulted and c in self.FALLBACK]
        if not fallback:
            return units
        kept = [Unit(u.key, u.role, u.params, [math.inf if i in fallback else b for i, b in enumerate(u.bits)])
                for u in units]  # fmt: skip
        if any(all(math.isinf(b) for b in u.bits) for u in kept) or sum(min(u.bits) for u in kept) > budget:
            logger.info("seqcal: %s: the budget needs 2-bit modules: %s among the candidates", self.where,
                        ", ".join(self.FALLBACK))  # fmt: skip
            return units
        return kept

    def _budget(self, model: torch.nn.Module, modules: dict[str, Any], params: int) -> tuple[float, str]:
        """Bits the quantized modules may take, and a note on the checkpoint for the error message."""
        if self.size is None:
            return float(self.average_bits) * params, "scales and zero points counted"  # type: ignore[arg-type]
        quantized = {id(model.get_submodule(n).weight) for n in modules}
        rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in quantized)
        return (self.size - rest) * 8.0, f"beside {rest / 1e6:.1f} MB of unquantized tensors"

    def assign(self, names: list[str], model: torch.nn.Module, modules: dict[str, QuantizationScheme],
               state: RunState, inputs_of: InputsOf, rounded: Rounding) -> None:  # fmt: skip
        """Set the scheme of each unit among ``names`` not chosen yet, from its errors under every candidate.

        Args:
            names: the modules about to be quantized (weights loaded, statistics gathered).
            modules: the modifier's module -> scheme, updated in place.
            inputs_of: a module's input statistics (Hessian, or E[x^2]) to measure its errors with.
            rounded: the weight rounded to nearest under a candidate, whose error predicts the solver's.
        """
        assert self.allocation is not None, "validate() first"
        self.catch_up(modules, state)
        for key, members in self.units.items():
            if key in self.chosen or not any(m in names for m in members):
                continue
            present = [m for m in members if m in names]
            unit = self.allocation.units[key]
            curves = {
                m: error_curve(
                    model.get_submodule(m).weight.data, self.schemes, *inputs_of(m), rounded, unit.bits
                )
                for m in present
            }
            share = unit.params / sum(model.get_submodule(m).weight.numel() for m in present)
            errors = [share * sum(self._weighted(curves[m][c], model.get_submodule(m).weight) for m in present)
                      for c in range(len(self.schemes))]  # fmt: skip
            errors = [e if math.isfinite(b) else math.inf for e, b in zip(errors, unit.bits)]
            step = len(self.chosen)
            index = self.chosen[key] = self.allocation.choose(key, errors)
            # what the choices after this one depend on: the unit's curve, in the order the units were chosen
            record = {"unit": key, "step": step, "errors": errors}
            state.results.module_errors.setdefault(present[0], {})[ALLOCATION_KEY] = record
            for m in members:
                modules[m] = self.schemes[index]
                report = state.results.module_errors.setdefault(m, {})
                weight = model.get_submodule(m).weight
                report.update(
                    scheme=self.labels[index], bits=_bits(self.schemes[index], weight) / weight.numel()
                )
                if m in curves:
                    report["predicted_rel_error"] = relative(*curves[m][index])
            logger.info("seqcal: %s -> %s (%.3f bits per weight, lambda %.3g)", key, self.labels[index],
                        unit.bits[index] / unit.params, self.allocation.choices[key].lam)  # fmt: skip

    def catch_up(self, modules: dict[str, QuantizationScheme], state: RunState) -> None:
        """Take the choices made elsewhere: units another process solved, or a resumed run replayed.

        Each choice left its unit's error curve and its step in the report entry of the unit's first module
        (``allocation``), which travels with the module's codes to the other processes and into the resume files.
        Choosing again from those curves, in the order they were first chosen, gives this allocation the state
        (budget spent, curves per role) that the process which chose them had, so the choices after them are the
        same whichever process makes them and whether the run was interrupted.

        Raises:
            RuntimeError: a recorded choice is not the one its curve gives here (the allocation would diverge).
        """
        assert self.allocation is not None, "validate() first"
        records = []
        for key, members in self.units.items():
            entries = [state.results.module_errors.get(m, {}) for m in members]
            record = next((e[ALLOCATION_KEY] for e in entries if ALLOCATION_KEY in e), None)
            if key not in self.chosen and record is not None and record["unit"] == key:
                records.append(record)
            elif key not in self.chosen and all(m in state.results.quantized for m in members):
                raise RuntimeError(f"{self.where}: {key} was quantized without a record of its allocation (a resume "
                                   "file written by an older seqcal); start the run again with overwrite=True")  # fmt: skip
        for record in sorted(records, key=lambda r: r["step"]):
            key = record["unit"]
            if record["step"] != len(self.chosen):
                raise RuntimeError(f"{self.where}: the allocation of {key} was step {record['step']}, but only "
                                   f"{len(self.chosen)} units were chosen before it here; the records of the units "
                                   "before it are missing (start the run again with overwrite=True)")  # fmt: skip
            index = self.chosen[key] = self.allocation.choose(key, [float(e) for e in record["errors"]])
            label = state.results.module_errors.get(self.units[key][0], {}).get("scheme", self.labels[index])
            if label != self.labels[index]:
                raise RuntimeError(f"{self.where}: {key} was quantized as {label}, but its recorded curve chooses "
                                   f"{self.labels[index]} here; the allocation cannot continue from it")  # fmt: skip
            for m in self.units[key]:
                modules[m] = self.schemes[index]

    def _weighted(self, errors: tuple[float, float], weight: torch.Tensor) -> float:
        """What the allocation sums over modules: the output error itself (``error: absolute``), or the relative
        error squared times the weight's size (``error: relative``)."""
        num, den = errors
        if self.error == "absolute" or not math.isfinite(num):
            return num
        return weight.numel() * num / den if den > 0 else 0.0

    def measured(self, name: str, before: torch.Tensor, after: torch.Tensor, diag: torch.Tensor | None,
                 state: RunState) -> None:  # fmt: skip
        """Round to nearest: the module's relative output error as quantized, beside the predicted one."""
        if diag is not None:
            error = relative(*output_errors(before, after, None, diag))
            state.results.module_errors.setdefault(name, {})["rel_error"] = error

    def finish(self, solver: str, arguments: dict[str, Any], modules: dict[str, QuantizationScheme],
               model: torch.nn.Module, state: RunState) -> None:  # fmt: skip
        """After the pass: the allocation reached (logged) and the recipe that replays it (an output file)."""
        self.catch_up(modules, state)  # the units other processes solved since this one's last choice
        line = self.summary(modules, model)
        logger.info("seqcal: %s", line)
        # in the model's order: replayed and received modules reach state.results.quantized in another order
        quantized = {n: state.results.quantized[n] for n in modules if n in state.results.quantized}
        if quantized:
            state.results.files[RECIPE_FILENAME] = self.replay_recipe(solver, arguments, quantized, line)

    def summary(self, modules: dict[str, QuantizationScheme], model: torch.nn.Module) -> str:
        """One line: the bits per weight the allocation reached against the budget."""
        weights = [model.get_submodule(n).weight for n in modules]
        spent = sum(_bits(modules[n], p) for n, p in zip(modules, weights))
        asked = f"average_bits {self.average_bits}" if self.size is None else f"max_size {self.max_size}"
        return (f"mixed precision: {spent / max(self.params, 1):.4f} bits per weight over {len(modules)} modules "
                f"({spent / 8e6:.3f} MB of quantized weights; budget {asked})")  # fmt: skip

    def replay_recipe(
        self, modifier: str, arguments: dict[str, Any], quantized: dict[str, Any], head: str
    ) -> str:
        """A recipe that quantizes every module with the scheme chosen for it (``modifier`` with ``arguments``
        and one config group per scheme, targeting the modules by name)."""
        groups: dict[str, dict[str, Any]] = {}
        for name, qw in quantized.items():
            spec = json.loads(qw.scheme.model_dump_json(exclude_none=True, exclude={"targets"}))
            key = json.dumps(spec, sort_keys=True)
            groups.setdefault(key, {"targets": [], **spec})["targets"].append(name)
        config_groups = {f"group_{i}": g for i, g in enumerate(groups.values())}
        body = {
            "DEFAULT_stage": {"DEFAULT_modifiers": {modifier: {**arguments, "config_groups": config_groups}}}
        }
        return f"# {head}\n" + yaml.safe_dump(body, sort_keys=False, default_flow_style=None)


def _size(value: int | str, where: str) -> int:
    """``max_size`` in bytes: an int, or ``'70MB'`` / ``'1.5GiB'`` as ``run_args.parse_bytes`` reads memory sizes
    (not imported: run_args reads recipes, which import the modifiers)."""
    units = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1}
    text = str(value).strip().upper().replace(" ", "")
    unit = next((u for u in units if text.endswith(u)), "")
    try:
        size = int(float(text[: len(text) - len(unit)]) * units.get(unit, 1))
    except ValueError:
        size = 0
    if isinstance(value, bool) or size <= 0:
        raise ValueError(f"{where}: max_size={value!r} is not a size; give bytes or a size such as '70MB'")
    return size


def _bits(scheme: QuantizationScheme, weight: torch.Tensor) -> float:
    return stored_bits(scheme, (weight.shape[0], weight.shape[-1]), weight.element_size() * 8)


def _check_pinned(members: tuple[str, ...], modules: dict[str, Any], pinned: set[str], where: str) -> None:
    """A unit the engine loads as one weight is pinned whole, to one scheme."""
    if not pinned.issuperset(members) or len({id(modules[m]) for m in members}) > 1:
        raise ValueError(f"{where}: pin gives {', '.join(members)} different schemes (or pins only some), but a "
                         "serving engine loads them as one weight; pin all of them to one scheme")  # fmt: skip
