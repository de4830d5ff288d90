"""The trace-equivalence check of one auto-zoo architecture, classified (shared by tests and benchmarks).

``check(model_type)`` builds the tiny model (``tests/autozoo.py``), runs it eagerly, traces it with
``seqcal.trace_subgraphs`` on batch 1 / 12 tokens, runs the subgraphs on batch 2 / 9 tokens with left
padding, and compares every output tensor with eager ``model(**inputs)`` (the tolerance of
``tests/test_trace_equivalence.py``: max abs diff <= 1e-5 * max(1, |eager|max)). The subgraph count is
right when it equals the number of target layers eager forward calls, plus one, counted by an oracle
that does not use seqcal's own target inference (``expected_targets``).

Statuses, best to worst: ``ok``; ``count-wrong`` (outputs equal, subgraph count not);
``refused`` (TracingError at trace time: loud); ``runtime-error`` (traced, then failed when run);
``mismatch`` (traced and ran, outputs differ: silent, the worst); and the setup classes ``no-tiny-build``
(the tiny config or model does not build) and ``no-eager`` (its eager forward fails or is not
deterministic), which say nothing about seqcal.

Example:
    >>> check("llama").status  # doctest: +SKIP
    'ok'
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from autozoo import AutoArch, build, candidates, family, make_inputs
from seqcal.execution.verify import output_tensors

STATUSES = ("ok", "count-wrong", "mismatch", "runtime-error", "refused", "no-eager", "no-tiny-build")
TOLERANCE = 1e-5
SAMPLE = {"batch": 1, "seq_len": 12, "left_pad": 0}
OTHER = {"batch": 2, "seq_len": 9, "left_pad": 3}
# Attribute names of layer stacks in transformers (model.layers, encoder.layer, transformer.h, block ...).
STACK_NAMES = ("layers", "layer", "h", "blocks", "block")


@dataclass
class Check:
    """The outcome for one architecture.

    Args:
        model_type: key of ``autozoo.candidates()``. class_name, family: the class checked and its family.
        status: one of ``STATUSES``.
        error: the error's first line (or the mismatch), ``where``: its file:line.
        count, expected: subgraphs traced, and target layers eager calls + 1.
        diff: max relative difference of the outputs. seconds: time of the whole check.
    """

    model_type: str
    class_name: str = ""
    family: str = ""
    status: str = "ok"
    error: str = ""
    where: str = ""
    count: int | None = None
    expected: int | None = None
    diff: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def first_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: first informative line``; for a TracingError, its first problem's ``what``."""
    problems = getattr(exc, "problems", None)
    text = problems[0].what if problems else str(exc)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    head = lines[0] if lines else ""
    if head.endswith(":") and len(lines) > 1:  # a heading ("... validation error:"): the cause is next
        head = f"{head} {lines[1]}"
    line = f"{type(exc).__name__}: {head}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def location(exc: BaseException) -> str:
    """``file:line`` of the failure: a TracingError's first problem, else the innermost frame."""
    problems = getattr(exc, "problems", None)
    if problems:  # "file:line in Class.method", or a module's qualified name
        where = problems[0].where.split(" in ")[0]
        return os.path.basename(where) if os.sep in where else where
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"


def compare(got: Any, want: Any) -> tuple[float, str]:
    """(worst diff / scale, '' or what differs) over every output tensor; NaNs must sit in the same places."""
    got_t, want_t = output_tensors(got), output_tensors(want)
    if got_t.keys() != want_t.keys():
        return float("inf"), f"output structure differs: {sorted(got_t)} vs {sorted(want_t)}"
    if not want_t:
        return float("inf"), "the model output holds no tensor to compare"
    worst, where = 0.0, ""
    for key, ref in want_t.items():
        out = got_t[key]
        if out.shape != ref.shape:
            return float("inf"), f"{key}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
        if not ref.numel() or not ref.is_floating_point():
            if not torch.equal(out, ref):
                return float("inf"), f"{key}: values differ"
            continue
        ref_nan, out_nan = torch.isnan(ref), torch.isnan(out)
        if not torch.equal(ref_nan, out_nan):
            return float("inf"), f"{key}: NaNs in other places"
        finite = ~ref_nan
        scale = max(1.0, ref[finite].float().abs().max().item()) if finite.any() else 1.0
        diff = (out[finite].float() - ref[finite].float()).abs().max().item() if finite.any() else 0.0
        if diff / scale > worst:
            worst, where = diff / scale, key
    return worst, "" if worst <= TOLERANCE else f"{where}: max abs diff / scale {worst:.3g}"


def expected_targets(model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[list[str], Any]:
    """Target layers eager forward calls, found without seqcal: the oracle of the subgraph count.

    A target is a module held directly in an ``nn.ModuleList``, outside the non-text towers (pretrained
    sub-models configured by a sub-config other than the text config: vision, audio), whose forward
    ``model(**inputs)`` runs (counted on the forward itself, so ``layer.forward(x)`` counts too); nested ones
    count once, by their outermost. Which lists hold targets, first rule that finds some:
    1. members whose class the model declares in ``_no_split_modules`` (its own or a pretrained model's
       inside it);
    2. members of a list named as transformers names its layer stacks (``STACK_NAMES``), or of a list inside
       one (blocks of layers: ``encoder.blocks.0.1``);
    3. the repeated blocks of a model that has no per-layer module (XLM's ``attentions`` and ``ffns``): every
       list of at least two members of one class with parameters that is not one of torch.nn's own.

    Returns:
        The called targets' names in call order, and the output of that forward.
    """
    from transformers import PreTrainedModel

    declared = {c for m in model.modules() for c in (getattr(m, "_no_split_modules", None) or ())}
    text = model.config.get_text_config()
    subs = [getattr(model.config, k, None) for k in getattr(model.config, "sub_configs", {})]
    others = [c for c in subs if c is not None and c is not text]
    towers = [
        n + "."
        for n, m in model.named_modules()
        if n and isinstance(m, PreTrainedModel) and any(m.config is c for c in others)
    ]
    lists = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)}

    def stack_named(n: str) -> bool:
        leaf, parent = n.rsplit(".", 1)[-1], n.rsplit(".", 1)[0] if "." in n else ""
        return leaf in STACK_NAMES or (parent in lists and parent.rsplit(".", 1)[-1] in STACK_NAMES)

    def repeated(m: torch.nn.ModuleList) -> bool:
        kinds = {type(c) for c in m.children()}
        kind = next(iter(kinds), None)
        return (
            len(m) >= 2 and len(kinds) == 1 and not kind.__module__.startswith("torch.nn")
            and any(True for _ in m.parameters())
        )  # fmt: skip

    rules = [
        lambda n, m, child: type(child).__name__ in declared,
        lambda n, m, child: stack_named(n) and not isinstance(child, torch.nn.ModuleList),
        lambda n, m, child: repeated(m),
    ]
    for rule in rules:
        listed = {
            f"{n}.{k}": child
            for n, m in lists.items()
            for k, child in m.named_children()
            if rule(n, m, child)
        }
        names = [n for n in listed if not any(n.startswith(t) for t in towers)]
        names = [n for n in names if not any(n.startswith(o + ".") for o in names)]
        called, output = _called(model, inputs, {n: listed[n] for n in names})
        if called:
            return called, output
    return called, output


def _called(
    model: torch.nn.Module, inputs: dict[str, Any], modules: dict[str, torch.nn.Module]
) -> tuple[list[str], Any]:
    """Run ``model(**inputs)``; the ``modules`` whose forward ran, in call order, and the output."""
    called: list[str] = []

    def counting(name: str, forward: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if name not in called:
                called.append(name)
            return forward(*args, **kwargs)

        return wrapped

    for name, module in modules.items():
        module.forward = counting(name, module.forward)  # an instance attribute: ``del`` restores the class's
    try:
        with torch.no_grad():
            output = model(**inputs)
    finally:
        for module in modules.values():
            del module.forward
    return called, output


def _fail(result: Check, status: str, exc: BaseException) -> Check:
    result.status, result.error, result.where = status, first_line(exc), location(exc)
    return result


def check(model_type: str, arch: AutoArch | None = None) -> Check:
    """Build, run eagerly, trace, run partitioned and compare one architecture; never raises.

    Args:
        model_type: key of ``autozoo.candidates()``.
        arch: the candidate, when the caller has it already.

    Returns:
        The classified ``Check``.
    """
    from seqcal import trace_subgraphs

    start = time.perf_counter()
    arch = arch or candidates()[model_type]
    result = Check(model_type, arch.class_name, arch.family)
    try:
        try:
            model = build(arch)
            result.family = family(arch, model)
        except Exception as exc:  # noqa: BLE001 - any failure is the result
            return _fail(result, "no-tiny-build", exc)
        try:
            sample, other = make_inputs(model, **SAMPLE), make_inputs(model, **OTHER)
            with torch.no_grad():
                model(**sample)
                want = model(**other)
            targets, again = expected_targets(model, other)  # its forward also checks determinism
        except Exception as exc:  # noqa: BLE001
            return _fail(result, "no-eager", exc)
        diff, what = compare(again, want)
        if what:
            result.status, result.error = "no-eager", f"eager forward is not deterministic: {what}"
            return result
        result.expected = len(targets) + 1
        try:
            subgraphs = trace_subgraphs(model, sample)
        except Exception as exc:  # noqa: BLE001
            return _fail(result, "refused", exc)
        result.count = len(subgraphs)
        try:
            got = subgraphs.run(**other)
        except Exception as exc:  # noqa: BLE001
            return _fail(result, "runtime-error", exc)
        result.diff, what = compare(got, want)
        if what:
            result.status, result.error = "mismatch", what
        elif result.count != result.expected:
            result.status = "count-wrong"
            result.error = f"{result.count} subgraphs, want {result.expected}: seqcal targets " + (
                f"{_classes(model, subgraphs.targets)}, eager calls {_classes(model, targets)}"
            )
        return result
    finally:
        result.seconds = round(time.perf_counter() - start, 2)


def _classes(model: torch.nn.Module, names: list[str]) -> str:
    counts: dict[str, int] = {}
    for name in names:
        cls = type(model.get_submodule(name)).__name__
        counts[cls] = counts.get(cls, 0) + 1
    return ", ".join(f"{n}x {c}" for c, n in counts.items()) or "none"
