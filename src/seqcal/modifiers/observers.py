"""Activation observers: running statistics of a module's inputs that become its static scale and zero point.

Names and semantics are llm-compressor's (the ``observer`` of a scheme's ``input_activations``), so a recipe
means the same thing here:

    minmax             moving average of each batch's min / max (``averaging_constant``, default 0.01)
    static_minmax      min / max over all batches
    memoryless_minmax  min / max of the last batch
    mse                moving average of each batch's MSE-searched range (grid search below the min / max)
    memoryless_mse     MSE-searched range of the last batch

A batch ``x [..., in]`` is reduced per qparam as llm-compressor flattens activations: ``tensor`` reduces
everything to one value ``[1]``; ``attn_head`` (keys / values ``[tokens, heads, head_dim]``, see
``seqcal.modifiers.kv_cache``) reduces all but the heads to ``[heads]``; ``group`` (and ``tensor_group``, NVFP4
inputs) reduces tokens and the columns of each group to ``[in // group]``.
The qparams then follow compressed-tensors' ``calculate_qparams`` (``seqcal.algorithms.compute_qparams``).
Padding tokens are left out by the caller. Dynamic activations have no observer: their qparams are computed
from each input at run time (``seqcal.modifiers.activations``).

Example:
    >>> args = QuantizationArgs(num_bits=8, strategy="tensor", type="float")
    >>> obs = make_observer(args)
    >>> obs.update(torch.randn(32, 64))
    >>> scale, zero_point = obs.qparams()

Weight observers (``weights.observer``: minmax, mse, imatrix_mse, ...) are range searches run once per weight
(``seqcal.algorithms.observe``); :func:`check_weight_observer` refuses a name or setting they do not have, and
:func:`apply_observer_overrides` applies the modifier-level ``weight_observer`` / ``input_observer`` /
``observer`` arguments as llm-compressor does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from torch import Tensor

from seqcal.algorithms import OBSERVERS as WEIGHT_OBSERVERS
from seqcal.algorithms import compute_qparams, observe_mse

Range = tuple[Tensor, Tensor]
# Strategies a static input scale can have in compressed-tensors (it refuses static token and channel).
STATIC_INPUT_STRATEGIES = ("tensor", "group")
DEFAULT_OBSERVER = "minmax"  # compressed-tensors: "defaults to min-max when not using dynamic quantization"


def _value(enum_or_str: object) -> str:
    return str(getattr(enum_or_str, "value", enum_or_str))


def _as_rows(x: Tensor, args: QuantizationArgs) -> Tensor:
    """``x [..., in]`` as one row per qparam: tensor -> [1, numel], group -> [in // group, tokens * group]."""
    if _value(args.strategy) == "tensor":
        return x.reshape(1, -1)
    if (
        _value(args.strategy) == "attn_head"
    ):  # keys / values [tokens, heads, head_dim] -> [heads, tokens * head_dim]
        return x.transpose(0, 1).reshape(x.shape[1], -1)
    G = x.shape[-1] // args.group_size
    return x.reshape(-1, G, args.group_size).transpose(0, 1).reshape(G, -1)


def batch_minmax(x: Tensor, args: QuantizationArgs) -> Range:
    """Min and max of one batch per qparam ([1] or [groups]), in x's dtype."""
    if _value(args.strategy) in ("group", "tensor_group"):
        # over the tokens first (contiguous columns), then within each group: no transposed copy of x
        columns = x.reshape(-1, x.shape[-1])
        groups = (x.shape[-1] // args.group_size, args.group_size)
        return columns.amin(dim=0).view(groups).amin(dim=-1), columns.amax(dim=0).view(groups).amax(dim=-1)
    rows = _as_rows(x, args)
    return rows.amin(dim=-1), rows.amax(dim=-1)


def batch_mse(x: Tensor, args: QuantizationArgs) -> Range:
    """The range per qparam, shrunk from the min / max to minimise ``sum |fake_quant(x) - x| ** norm``.

    The search settings are llm-compressor's ``observer_kwargs`` (maxshrink 0.2, grid 100, patience 5,
    norm 2.4), as for weights (``seqcal.algorithms.observe_mse``).
    """
    kw = args.observer_kwargs or {}
    lo, hi = observe_mse(
        _as_rows(x, args), strategy="channel", num_bits=args.num_bits, symmetric=args.symmetric,
        type=_value(args.type), maxshrink=kw.get("maxshrink", 0.2), grid=int(kw.get("grid", 100)),
        patience=kw.get("patience", 5), norm=kw.get("norm", 2.4),
    )  # fmt: skip
    return lo.reshape(-1), hi.reshape(-1)


def _moving_average(constant: float) -> Callable[[Range | None, Range], Range]:
    def combine(past: Range | None, now: Range) -> Range:
        if past is None or constant == 1.0:
            return now
        # llm-compressor's lerp: past * (1 - c) + now * c (torch.lerp lacks some dtypes)
        return past[0] * (1.0 - constant) + now[0] * constant, past[1] * (1.0 - constant) + now[1] * constant

    return combine


def _running_extremes(past: Range | None, now: Range) -> Range:
    return now if past is None else (torch.minimum(past[0], now[0]), torch.maximum(past[1], now[1]))


def _last(past: Range | None, now: Range) -> Range:
    return now


@dataclass
class ActivationObserver:
    """Statistics of one module's inputs over the calibration batches.

    Attributes:
        args: the scheme's ``input_activations``.
        measure: one batch -> its range per qparam (``batch_minmax`` or ``batch_mse``).
        combine: (running range or None, batch range) -> new running range.
        range: the running (min, max), None before the first batch.
    """

    args: QuantizationArgs
    measure: Callable[[Tensor, QuantizationArgs], Range]
    combine: Callable[[Range | None, Range], Range]
    range: Range | None = field(default=None)

    def update(self, x: Tensor, measured: Range | None = None) -> None:
        """Add one batch ``x [tokens, in]`` (``measured``: its range, when already computed for a sibling)."""
        self.range = self.combine(
            self.range, measured if measured is not None else self.measure(x, self.args)
        )

    def qparams(self) -> tuple[Tensor, Tensor]:
        """Scale and zero point ([1] or [groups]) from the running range.

        Raises:
            RuntimeError: no batch was observed.
        """
        if self.range is None:
            raise RuntimeError("ActivationObserver.qparams: no input was observed")
        lo, hi = self.range
        return compute_qparams(lo, hi, num_bits=self.args.num_bits, symmetric=self.args.symmetric,
                               type=_value(self.args.type))  # fmt: skip


def _minmax(args: QuantizationArgs) -> ActivationObserver:
    constant = (args.observer_kwargs or {}).get("averaging_constant", 0.01)
    return ActivationObserver(args, batch_minmax, _moving_average(constant))


def _mse(args: QuantizationArgs) -> ActivationObserver:
    constant = (args.observer_kwargs or {}).get("averaging_constant", 0.01)
    return ActivationObserver(args, batch_mse, _moving_average(constant))


# Observer name (llm-compressor's registry names) -> constructor. A literal dict: a miss lists these names.
OBSERVERS: dict[str, Callable[[QuantizationArgs], ActivationObserver]] = {
    "minmax": _minmax,
    "static_minmax": lambda args: ActivationObserver(args, batch_minmax, _running_extremes),
    "memoryless_minmax": lambda args: ActivationObserver(args, batch_minmax, _last),
    "mse": _mse,
    "memoryless_mse": lambda args: ActivationObserver(args, batch_mse, _last),
}


def observer_name(args: QuantizationArgs) -> str:
    """The observer a static activation uses: the scheme's own, else compressed-tensors' default min-max."""
    return args.observer or DEFAULT_OBSERVER


def check_static_input(args: QuantizationArgs, where: str) -> None:
    """Refuse a static input-activation setting seqcal cannot calibrate, naming what is valid.

    Args:
        args: a scheme's ``input_activations`` (static).
        where: the modifier and group, for the message.

    Raises:
        ValueError: an unknown observer, or a strategy compressed-tensors cannot store as a static scale.

    Example:
        >>> check_static_input(QuantizationArgs(strategy="tensor", observer="minmax"), "GPTQModifier")
    """
    name = observer_name(args)
    if name not in OBSERVERS:
        raise ValueError(
            f"{where}: input_activations observer {name!r} does not exist; valid observers: "
            f"{', '.join(OBSERVERS)}"
        )
    if _value(args.type) == "float" and not args.symmetric:
        raise ValueError(f"{where}: fp8 input activations must be symmetric; set symmetric: true")
    strategy = _value(args.strategy)
    if strategy == "tensor_group" and _value(args.dynamic) == "local":
        return  # NVFP4 inputs: the observed range gives the global scale, the group scales are dynamic
    if strategy not in STATIC_INPUT_STRATEGIES:
        raise ValueError(
            f"{where}: static input activations cannot use strategy {strategy!r} (compressed-tensors stores "
            f"static input scales per {' or '.join(STATIC_INPUT_STRATEGIES)}); use strategy 'tensor', or "
            f"set dynamic: true for per-token scales"
        )


def make_observer(args: QuantizationArgs) -> ActivationObserver:
    """A fresh observer for a static ``input_activations`` (its ``observer`` name, default ``minmax``).

    Args:
        args: the scheme's input activation arguments.

    Returns:
        The observer.

    Raises:
        ValueError: as :func:`check_static_input`.

    Example:
        >>> make_observer(QuantizationArgs(strategy="tensor", observer="static_minmax")).range is None
        True
    """
    check_static_input(args, "input_activations")
    return OBSERVERS[observer_name(args)](args)


# llm-compressor's NVFP4 range-expansion observers: their search runs on fp4 groups, which seqcal's search
# does not quantize with yet.
_NOT_YET = ("nvfp4_expanded_mse", "fouroversix", "nvfp4_expanded_imatrix")


def _search_setting_error(name: str, kw: dict) -> str | None:
    """What is wrong with a weight search's ``observer_kwargs`` (llm-compressor's checks), or None."""
    number = (int, float)
    if name == "imatrix_mse":
        grid, patience, maxshrink = kw.get("grid", 20), kw.get("patience", 5), kw.get("maxshrink", 0.95)
        norm = kw.get("norm", 3.0)
        if not isinstance(grid, number) or grid <= 0:
            return f"grid must be > 0, got {grid!r}"
        if not isinstance(patience, number) or patience < 0:
            return f"patience must be >= 0, got {patience!r}"
        if not isinstance(maxshrink, number) or not 0 <= maxshrink <= 1:
            return f"maxshrink must be in [0, 1], got {maxshrink!r}"
        if isinstance(norm, bool) or not isinstance(norm, number) or not math.isfinite(norm) or norm <= 0:
            return f"norm must be a finite positive number, got {norm!r}"
    elif name in ("mse", "memoryless_mse") and kw.get("expand", 1.0) < 1.0:
        return f"expand must be at least 1.0, got {kw['expand']!r}"
    return None


def check_weight_observer(args: QuantizationArgs, where: str) -> None:
    """Refuse a weight observer seqcal does not have, or search settings llm-compressor would refuse.

    Args:
        args: a scheme's ``weights``.
        where: the modifier and group, for the message.

    Raises:
        ValueError: one sentence naming the valid observers or the bad setting.

    Example:
        >>> check_weight_observer(QuantizationArgs(num_bits=4, observer="imatrix_mse"), "GPTQModifier")
    """
    name = args.observer or DEFAULT_OBSERVER
    if name in _NOT_YET:
        raise ValueError(
            f"{where}: weight observer {name!r} (NVFP4 range expansion) is not supported yet; valid weight "
            f"observers: {', '.join(WEIGHT_OBSERVERS)}"
        )
    if name not in WEIGHT_OBSERVERS:
        raise ValueError(
            f"{where}: weights observer {name!r} does not exist; valid weight observers: "
            f"{', '.join(WEIGHT_OBSERVERS)}"
        )
    problem = _search_setting_error(name, dict(args.observer_kwargs or {}))
    if problem:
        raise ValueError(f"{where}: weights observer_kwargs of {name!r}: {problem}")


def apply_observer_overrides(
    groups: dict[str, QuantizationScheme],
    where: str,
    weight_observer: str | None = None,
    input_observer: str | None = None,
    output_observer: str | None = None,
    observer: dict[str, str] | None = None,
) -> None:
    """Set the observers named by a modifier's arguments on every group's args, as llm-compressor does.

    ``observer`` (keys ``weights``, ``input``, ``output``) takes precedence; giving it together with one of the
    single arguments is an error. Args a group does not have (no input activations) are left alone, and so are
    dynamic ones (they have no observer).

    Args:
        groups: group name -> scheme (changed in place).
        where: the modifier, for messages.
        weight_observer, input_observer, output_observer, observer: the modifier's arguments.

    Raises:
        ValueError: both forms given, or an unknown key or non-string value in ``observer``.

    Example:
        >>> apply_observer_overrides(groups, "GPTQModifier", weight_observer="mse")  # doctest: +SKIP
    """
    single = {"weights": weight_observer, "input": input_observer, "output": output_observer}
    if observer is not None:
        if any(v is not None for v in single.values()):
            raise ValueError(
                f"{where}: give either weight_observer / input_observer / output_observer or observer, not both"
            )
        if not isinstance(observer, dict):
            raise ValueError(
                f"{where}: observer must be a mapping such as {{weights: mse}}, got {observer!r}"
            )
        for key, value in observer.items():
            if key not in single or not isinstance(value, str):
                raise ValueError(
                    f"{where}: observer has {key!r}: {value!r}; keys are weights, input, output and values names"
                )
        single = {k: observer.get(k) for k in single}
    attrs = {"weights": "weights", "input": "input_activations", "output": "output_activations"}
    for key, name in single.items():
        for scheme in groups.values():
            args = getattr(scheme, attrs[key])
            if name is not None and args is not None and args.dynamic is not True:
                args.observer = name
