"""What a checkpoint says about the model: ``quantization_config`` and ``config.json``.

``quantization_config`` builds compressed-tensors' config block, and ``checkpoint_config`` checks that its
targets and ignore list give exactly the quantized modules on load (falling back to exact module names when
they would not), naming modules as the checkpoint does (``ModelLayout``, ``seqcal.checkpoint.layout``).
``seqcal.checkpoint.writer`` writes the weights and re-exports these names.

Example:
    >>> layout = ModelLayout.from_model(model)  # doctest: +SKIP
    >>> checkpoint_config(model, state, layout)["quantization_config"]["format"]  # doctest: +SKIP
    'pack-quantized'
"""

from __future__ import annotations

import copy
import json
import logging
import re
from collections.abc import Sequence

import compressed_tensors
import torch
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, QuantizationStatus
from compressed_tensors.quantization.quant_config import get_vllm_module_type
from compressed_tensors.utils.match import is_match, match_named_modules, match_targets

from seqcal.checkpoint.layout import ModelLayout
from seqcal.checkpoint.sparse import sparsity_block
from seqcal.modifiers.base import RunState

logger = logging.getLogger(__name__)

WRITABLE_FORMATS = (
    "pack-quantized",
    "int-quantized",
    "float-quantized",
    "naive-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
    "mxfp6-pack-quantized",
    "mxfp8-quantized",
)
# formats whose weights compressed-tensors 0.20 decompresses to bfloat16 whatever the model's dtype
MINIFLOAT_FORMATS = (
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
    "mxfp6-pack-quantized",
    "mxfp8-quantized",
)


def _format(scheme: QuantizationScheme) -> str:
    """The compressed-tensors format of a Linear quantized with ``scheme`` (its own choice unless set)."""
    fmt = scheme.format or infer_module_format(torch.nn.Linear, scheme)
    fmt = str(getattr(fmt, "value", fmt))
    if fmt not in WRITABLE_FORMATS:
        raise ValueError(
            f"save: format {fmt!r} is not supported; seqcal writes {', '.join(WRITABLE_FORMATS)}"
        )
    return fmt


def _groups(state: RunState, order: Sequence[str] = ()) -> tuple[list[QuantizationScheme], dict[str, int]]:
    """The distinct schemes the quantized modules hold (``QuantizedWeight.scheme``, a modifier's choice per module),
    in order of first use, and module name -> index of its scheme.

    The modules are taken in ``order`` (the model's), not in the order their results arrived: another process's
    modules and a resumed run's replayed ones arrive in another order, and the group numbers must not change.
    """
    position = {name: i for i, name in enumerate(order)}
    names = sorted(state.results.quantized, key=lambda n: position.get(n, len(position)))
    schemes: list[QuantizationScheme] = []
    index: dict[str, int] = {}
    for name in names:
        scheme = state.results.quantized[name].scheme
        if scheme not in schemes:
            schemes.append(scheme)
        index[name] = schemes.index(scheme)
    return schemes, index


def quantization_config(
    state: RunState, ignore: list[str], *, exact_targets: bool = False, order: Sequence[str] = ()
) -> dict:
    """The ``quantization_config`` block of ``config.json``, as compressed-tensors' ModelCompressor writes it.

    Args:
        state: the run's state; one config group per distinct scheme its quantized modules hold
            (``state.results.quantized[name].scheme``), whatever the recipe said.
        ignore: names of the modules the group targets match but that stay unquantized (e.g. ``lm_head``).
        exact_targets: target the quantized modules by exact name instead of the schemes' own targets.
        order: module names in the model's order (``named_modules``); the groups are numbered by their first
            module in it (modules it does not name come last, in their order of arrival).

    Returns:
        A JSON-ready dict: config_groups (each with its format), format (one format or "mixed-precision"),
        ignore, quant_method "compressed-tensors", quantization_status "compressed", version, ...

    Example:
        >>> quantization_config(state, ignore=["lm_head"])["format"]  # doctest: +SKIP
        'pack-quantized'
    """
    if not state.results.quantized:
        raise ValueError(
            "quantization_config: state.results.quantized is empty; save an unquantized model with save_pretrained"
        )
    schemes, index = _groups(state, order)
    _warn_experts_at_several_widths(index)
    groups = {}
    for i, scheme in enumerate(schemes):
        group = scheme.model_copy(deep=True)
        group.format = _format(scheme)
        if exact_targets:
            group.targets = sorted(n for n, j in index.items() if j == i)
        groups[f"group_{i}"] = group
    formats = {g.format for g in groups.values()}
    config = QuantizationConfig(
        config_groups=groups,
        format=formats.pop() if len(formats) == 1 else "mixed-precision",
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(ignore),
        kv_cache_scheme=state.config.kv_cache_scheme,
    )
    block = {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **config.model_dump(exclude={"quant_method"}),
    }
    block = json.loads(json.dumps(block))  # enums and dtypes as the strings config.json holds
    if needs_dequantize_load(block):
        block["dequantize"] = True
    return block


_EXPERT = re.compile(r"\.experts\.\d+\.")


def _warn_experts_at_several_widths(index: dict[str, int]) -> None:
    """Warn when an MoE model's experts hold more than one scheme across its layers.

    transformers (5.24) loads the experts of every MoE layer into its fused experts modules with one config
    group, the first that targets them (``integrations/compressed_tensors.py``), so such a checkpoint fails
    to load there with a size mismatch; compressed-tensors and vLLM resolve each expert's own group. The
    checkpoint is what was calibrated, so it is written; the warning says who cannot read it.
    """
    widths = {index[n] for n in index if _EXPERT.search(n)}
    if len(widths) > 1:
        logger.warning(
            "seqcal: the experts of this MoE model hold %d different schemes across its layers; compressed-tensors "
            "and vLLM load each at its own, but transformers' from_pretrained loads every layer's experts with one "
            "config group and refuses this checkpoint (give every expert one scheme, e.g. a mixed-precision pin "
            "'re:.*experts.*', for a checkpoint transformers loads)", len(widths),
        )  # fmt: skip


def runs_only_in_bfloat16(block: dict) -> bool:
    """Whether transformers can run this checkpoint only in bfloat16: minifloat weights (NVFP4, MX) with
    quantized input activations (NVFP4 W4A4, MXFP4, MXFP8). compressed-tensors 0.20 decompresses such weights
    to bfloat16 on the fly and, as the activations are quantized, they cannot be loaded dequantized instead
    (:func:`needs_dequantize_load`); vLLM runs them whatever the dtype.

    Example:
        >>> runs_only_in_bfloat16({"format": "nvfp4-pack-quantized", "config_groups": {"g": {"input_activations": {}}}})
        False
    """
    groups = list(block.get("config_groups", {}).values())
    return any(
        (g.get("format") or block.get("format")) in MINIFLOAT_FORMATS and bool(g.get("input_activations"))
        for g in groups
    )


def needs_dequantize_load(block: dict) -> bool:
    """Whether transformers must load this checkpoint with ``dequantize=True`` (asymmetric packed or minifloat weights).

    compressed-tensors stores the zero points of asymmetric channel/group ``pack-quantized`` weights packed
    along the output dimension (int32 ``[ceil(out * b / 32), groups]``); its decompressor and vLLM read
    that layout. But transformers' default (compressed) load path builds the empty module on the meta device
    and compresses it with compressed-tensors, whose meta branch leaves ``weight_zero_point`` unpacked
    (``[out, groups]``, its zp dtype); since transformers 5.24 (5.17 did not compare quantized parameters'
    shapes) the packed tensor is refused as a size mismatch. Its ``dequantize=True`` path decompresses the
    stored tensors directly and loads them. ``quantization_config`` therefore carries ``dequantize: true``
    for such checkpoints (vLLM and compressed-tensors ignore the key), so a plain ``from_pretrained`` works.
    The same holds for NVFP4 and MX weights: compressed-tensors 0.20 decompresses them to bfloat16 on the fly,
    which a float32 model cannot multiply (the compressed path only runs in bfloat16).
    Only when no group quantizes activations: ``dequantize`` loads a dense model without activation
    quantization, which would not be the calibrated model.

    Args:
        block: a ``quantization_config`` dict (as in ``config.json``).

    Returns:
        True when some group is asymmetric channel/group pack-quantized or an NVFP4 / MX format, and none
        quantizes activations.

    Example:
        >>> needs_dequantize_load(json.load(open("out/config.json"))["quantization_config"])  # doctest: +SKIP
        True
    """
    groups = list(block.get("config_groups", {}).values())
    packed_asym = any(
        (g.get("format") or block.get("format")) == "pack-quantized"
        and (g.get("weights") or {}).get("symmetric") is False
        and (g.get("weights") or {}).get("strategy") in ("channel", "group")
        for g in groups
    )
    minifloat = any((g.get("format") or block.get("format")) in MINIFLOAT_FORMATS for g in groups)
    activations = any(g.get("input_activations") or g.get("output_activations") for g in groups)
    return (packed_asym or minifloat) and not activations


def _assignment(model: torch.nn.Module, block: dict) -> dict[str, str]:
    """Module name -> config group, as compressed-tensors' apply_quantization_config resolves it on load."""
    target_to_group = {t: g for g, scheme in block["config_groups"].items() for t in scheme["targets"]}
    return {
        name: target_to_group[match_targets(name, module, target_to_group)[0]]
        for name, module in match_named_modules(model, target_to_group, block["ignore"])
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
    }


def _loaded_as_linear(module: torch.nn.Module) -> bool:
    """Whether vLLM builds ``module`` as a Linear layer though transformers does not: a MoE router or gate
    (``Qwen3MoeTopKRouter``, ``DeepseekV3TopkRouter``: its class name says router, gating or gate). vLLM's
    compressed-tensors loader quantizes every Linear that ``Linear`` targets and the ignore list does not
    name, so an unquantized router is listed, as compressed-tensors' ``QuantizationConfig.from_pretrained``
    (what llm-compressor writes) lists it."""
    return not isinstance(module, torch.nn.Linear) and get_vllm_module_type(type(module).__name__) == "Linear"


def _checked_block(model: torch.nn.Module, state: RunState, layout: ModelLayout) -> dict:
    """The quantization_config whose targets and ignore give exactly ``state.results.quantized`` on load."""
    modules = dict(model.named_modules())
    for name in state.results.quantized:
        if not isinstance(modules.get(name), torch.nn.Linear):
            raise ValueError(
                f"save: state.results.quantized names {name!r}, which is not a Linear of this model"
            )
        layout.check_quantizable(name)
    targets = [t for qw in state.results.quantized.values() for t in qw.scheme.targets]
    unquantized = [
        name
        for name, module in modules.items()
        if name not in state.results.quantized
        and (
            isinstance(module, torch.nn.Linear)
            or _loaded_as_linear(module)
            or (isinstance(module, torch.nn.Embedding) and is_match(name, module, targets))
        )
    ]
    ignore = [alias for name in unquantized for alias in layout.checkpoint_names(name)]
    block = quantization_config(state, ignore, order=list(modules))
    expected = {name: f"group_{i}" for name, i in _groups(state, list(modules))[1].items()}
    if _assignment(model, block) != expected:  # overlapping targets resolve differently in compressed-tensors
        block = quantization_config(state, ignore, exact_targets=True, order=list(modules))
        for group in block["config_groups"].values():
            group["targets"] = [a for n in group["targets"] for a in layout.checkpoint_names(n)]
    return block


def checkpoint_config(model: torch.nn.Module, state: RunState, layout: ModelLayout | None = None) -> dict:
    """``config.json`` content: the model's config as save_pretrained writes it, plus ``quantization_config``.

    The ignore list holds every unquantized Linear and MoE router (vLLM loads routers as Linears); when the
    schemes' own targets would resolve to other schemes than ``state.results.quantized`` in compressed-tensors
    (overlapping targets), the groups target the quantized modules by name instead.

    Args:
        model: the transformers model (only names, classes and its config are read).
        state: the run's state.
        layout: the layout the weights were written with (default: ``ModelLayout.from_model(model)``).

    Returns:
        A JSON-ready dict.

    Example:
        >>> writer.close(checkpoint_config(model, state, layout))  # doctest: +SKIP
    """
    layout = layout or ModelLayout.from_model(model)
    config = copy.deepcopy(model.config)  # the model's own config stays untouched
    config.dtype = str(getattr(model, "dtype", torch.float32)).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    data = json.loads(config.to_json_string(use_diff=True))
    results = state.results
    if (
        not (results.quantized or results.sparsity or results.transform_config)
        and state.config.kv_cache_scheme is None
    ):
        return data  # nothing compressed nor rotated online (experts removed only): a plain checkpoint
    data["quantization_config"] = (
        sparse_only_block() if not state.results.quantized else _checked_block(model, state, layout)
    )
    if state.results.transform_config:  # online rotations (QuIP, SpinQuant): compressed-tensors applies them
        data["quantization_config"]["transform_config"] = state.results.transform_config
    if state.results.sparsity:  # pruned modules (seqcal.checkpoint.sparse)
        names = {n: layout.checkpoint_names(n) for n in state.results.sparsity}
        data["quantization_config"]["sparsity_config"] = sparsity_block(model, state, names)
    if "source_format" in state.results.report:  # read from a quantized checkpoint (seqcal.sources)
        data["quantization_config"]["source_format"] = state.results.report["source_format"]
    return data


def sparse_only_block() -> dict:
    """``quantization_config`` of a pruned, unquantized model: nothing but the sparsity_config (filled in)."""
    return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors", "format": "dense",
            "sparsity_config": {}, "transform_config": {}}  # fmt: skip
