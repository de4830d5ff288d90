"""``keep_source_format`` in a model-free run: the FP8 Linears the scheme leaves alone keep their stored form.

An FP8 checkpoint (DeepSeek-V3/R1, Kimi-K2) quantized model-free to NVFP4 on its experts only would otherwise
write every other FP8 weight dequantized: twice its source bytes, and no more accurate. With
``keep_source_format`` each such Linear is written as ``oneshot(..., keep_source_format=True)`` writes it: its
float8 weight and float32 scales as the source stores them, in compressed-tensors' ``float-quantized`` form, under a
config group of its own. Which Linears qualify, and the scheme that describes their form, are
``KeepSourceFormatModifier``'s (the same sources refused with the same sentences); the plan gets one ``Quantize``
with ``keep`` per such weight, which the worker writes from the stored bytes without rounding anything.

Example:
    >>> plan = keep_source_form(plan, source, skeleton)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses

from seqcal.modelfree.plan import Plan, Quantize, Unit
from seqcal.modelfree.skeleton import Skeleton
from seqcal.modelfree.source import SourceCheckpoint
from seqcal.modifiers.keep_source import KeepSourceFormatModifier


def keep_source_form(plan: Plan, source: SourceCheckpoint, skeleton: Skeleton) -> Plan:
    """``plan`` with every FP8-stored Linear it does not quantize written in its stored form.

    Raises:
        ValueError: the source is not FP8 with dynamic activations, or no Linear of it is stored in FP8 (one
            sentence each, ``KeepSourceFormatModifier``'s).
    """
    keeper = KeepSourceFormatModifier(source=str(source.path))
    try:
        keeper.validate(skeleton.model)
    except ValueError as err:
        raise ValueError(str(err).replace(keeper.name, "model-free: keep_source_format", 1)) from None
    kept: dict[str, Quantize] = {}
    for module, key in keeper.stored.items():
        if module in plan.modules or key not in source.stored.parts:
            continue  # the scheme's, or not a weight this run reads dequantized
        kept[key] = Quantize(module, key, keeper.stored_scheme(module), keep=True)
    jobs = [
        dataclasses.replace(job, units=tuple(_kept_unit(unit, kept) for unit in job.units))
        for job in plan.jobs
    ]
    schemes = {**plan.modules, **{q.module: q.scheme for q in kept.values()}}
    order = [name for name, _ in skeleton.model.named_modules() if name in schemes]
    return Plan(jobs, {name: schemes[name] for name in order})


def _kept_unit(unit: Unit, kept: dict[str, Quantize]) -> Unit:
    """The unit with its FP8 weight kept, where it has one the plan does not quantize."""
    if unit.quantize is not None:
        return unit
    keep = next((kept[k] for k in unit.keys if k in kept), None)
    return unit if keep is None else dataclasses.replace(unit, quantize=keep)
