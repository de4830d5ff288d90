"""One module's tensors as GGUF tensors: names, types, bytes, and the check that llama.cpp computes seqcal's weights.

A Linear a GGUF scheme quantized is packed from its codes and scales (``seqcal.gguf.pack``) and read back with
gguf-py's ``gguf.quants.dequantize`` before anything is written: those float32 values, cast to the model's dtype,
must equal the module's fake-quantized weight, element for element, else :class:`GGUFCheckError` stops the save.
Weights no recipe module covers follow llama.cpp's rule for them (llama-quant.cpp): the token embedding and the
output projection are rounded to nearest on the type llama.cpp gives them in the file's mix (the output type
for a token embedding tied to the output), norms and biases are F32 (Gemma's norms plus one, as llama.cpp
multiplies by them), any other weight keeps the model's dtype.

Example:
    >>> entry = module_entries("model.norm", model.model.norm, None, plan)[0]  # doctest: +SKIP
    >>> entry.name, entry.ggml_type
    ('output_norm.weight', 0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch

from seqcal.errors import SeqcalError
from seqcal.gguf import grids
from seqcal.gguf.families import Family, permutation
from seqcal.gguf.gemma import norm_shifted
from seqcal.gguf.pack import pack
from seqcal.gguf.scheme import MIXES, GGUFScheme
from seqcal.gguf.types import type_for_width

_FLOAT_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


class GGUFCheckError(SeqcalError, RuntimeError):
    """The values llama.cpp would compute from a GGUF tensor differ from seqcal's quantized weight."""


@dataclass(frozen=True)
class FilePlan:
    """What a GGUF file is: its family, mix (llama.cpp's file type), and how to name and order its tensors.

    Attributes:
        family: the model family.
        config: the model's config.
        namer: HF parameter name -> GGUF tensor name.
        base: the type most tensors get ("Q4_K"), for the tensors no recipe module covers; None: keep them as they are.
        file_type: ``gguf.LlamaFileType`` value of ``general.file_type``.
        tied: the output projection is the token embedding (one tensor in the file).
    """

    family: Family
    config: Any
    namer: Any
    base: str | None
    file_type: int
    tied: bool


@dataclass
class Entry:
    """One tensor of the file: name, the numpy-order shape gguf-py takes, type, and bytes (freed once written)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    data: np.ndarray


def plan_types(schemes: list[GGUFScheme]) -> tuple[str | None, int]:
    """The base type and ``general.file_type`` of a run whose modules have ``schemes``."""
    if not schemes:
        return None, int(gguf.LlamaFileType.ALL_F32)
    mix = next((s.gguf_mix for s in schemes if s.gguf_mix), None)
    base = (
        MIXES[mix] if mix else max((s.gguf_type for s in schemes), key=[s.gguf_type for s in schemes].count)
    )
    names = {"Q2_K_MIX": "Q2_K", "Q2_K": "Q2_K", "Q3_K": "Q3_K_S", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S",
             "Q4_0_MIX": "Q4_0", "Q5_0_MIX": "Q5_0"}  # fmt: skip
    return base, int(gguf.LlamaFileType[f"MOSTLY_{names.get(mix or base, mix or base)}"])


def _edge_type(plan: FilePlan, output: bool, width: int) -> str | None:
    """llama.cpp's type for the token embedding / output projection in the file's mix (None: unquantized)."""
    if plan.base is None:
        return None
    if output or plan.tied:
        if width % 256 or plan.base == "Q8_0":
            return "Q8_0"
        return "Q6_K"
    return type_for_width(plan.base, width)  # llama.cpp's fallback; None: F16 there, the model's dtype here


def _quantized_entry(name: str, weight: torch.Tensor, qw: Any, plan: FilePlan) -> Entry:
    """The packed bytes of a GGUF-quantized Linear, checked against the module's weight."""
    fmt = grids.gguf_format(qw.scheme.gguf_type)
    data = pack(qw.q.cpu(), qw.scale.cpu(), None if qw.zero_point is None else qw.zero_point.cpu(), fmt)
    computed = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[fmt.gguf]))
    held = weight.detach().cpu()
    same = computed.shape == held.shape and bool(torch.equal(computed.to(held.dtype), held))
    if not same:
        worst = (
            (computed.to(torch.float32) - held.float()).abs().max().item()
            if computed.shape == held.shape
            else None
        )
        raise GGUFCheckError(
            f"GGUF check: {name} as llama.cpp reads it ({fmt.gguf}) differs from seqcal's quantized weight "
            f"(largest difference {worst}); the file was not written: report this with the recipe"
        )
    return Entry(name, data.shape, fmt.gtype.ggml_type, data)


def _rounded_entry(name: str, weight: torch.Tensor, kind: str) -> Entry:
    """A weight no recipe module quantized, rounded to nearest on ``kind``'s grid by llama.cpp's rule."""
    fmt = grids.gguf_format(kind)
    W = weight.detach().cpu().float()
    scale, zero = grids.qparams(W, fmt)
    data = pack(grids.quantize(W, scale, zero, fmt), scale, zero, fmt)
    return Entry(name, data.shape, fmt.gtype.ggml_type, data)


def _float_entry(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> Entry:
    kind = _FLOAT_TYPES.get(dtype, "F32")
    values = tensor.detach().cpu().to(dtype if kind != "F32" else torch.float32)
    raw = values.view(torch.int16).numpy().view(np.uint8) if kind == "BF16" else values.numpy()
    shape = tuple(values.shape) if kind != "BF16" else (*values.shape[:-1], values.shape[-1] * 2)
    return Entry(name, shape, int(gguf.GGMLQuantizationType[kind]), raw.reshape(shape))


def module_entries(name: str, module: torch.nn.Module, qw: Any, plan: FilePlan) -> list[Entry]:
    """The GGUF tensors of ``module``'s own parameters (its children have their own)."""
    entries = []
    for pname, param in module.named_parameters(recurse=False):
        hf_name = f"{name}.{pname}" if name else pname
        gguf_name = plan.namer(hf_name)
        if gguf_name is None:
            raise GGUFCheckError(f"GGUF: no llama.cpp tensor name for {hf_name} in the {plan.family.arch} "
                                 "architecture; save a compressed-tensors checkpoint instead")  # fmt: skip
        if gguf_name == "output.weight" and plan.tied and qw is None:
            continue  # the token embedding is the output projection: llama.cpp reads token_embd
        if pname == "weight" and qw is not None:
            entry = _quantized_entry(hf_name, param, qw, plan)
        elif param.dim() >= 2 and gguf_name in ("token_embd.weight", "output.weight"):
            kind = _edge_type(plan, gguf_name == "output.weight", param.shape[-1])
            entry = (
                _rounded_entry(hf_name, param, kind) if kind else _float_entry(hf_name, param, param.dtype)
            )
        elif plan.family.norm_shift and norm_shifted(hf_name):  # Gemma: x * (1 + w) is llama.cpp's x * w'
            entry = _float_entry(hf_name, param.detach().float() + 1, torch.float32)
        else:
            entry = _float_entry(hf_name, param, param.dtype if param.dim() >= 2 else torch.float32)
        entry.name = gguf_name
        order = permutation(plan.family, plan.config, gguf_name, entry.data.shape[0])
        if order is not None:
            entry.data = np.ascontiguousarray(entry.data[order])
        entries.append(entry)
    return entries
