"""KeepSourceFormatModifier: the Linears a recipe leaves alone keep their FP8 source form in the output.

A checkpoint published in FP8 (DeepSeek-V3/R1, Kimi-K2, Qwen3/GLM/MiniMax FP8 releases) is read dequantized, so
a recipe that quantizes only some of its modules (the experts to NVFP4, say) would write every other FP8 weight
in the run's dtype: twice its source bytes, and no more accurate, since the FP8 values are what was trained. With
this modifier (``keep_source_format=True``, ``--keep-source-format``, or named in the recipe after the others)
each such Linear is written as the source stores it: its float8 weight and its float32 scales
(``weight_scale_inv``, one per block or per tensor or row) as compressed-tensors' ``float-quantized`` format with
the source's dynamic FP8 activations, byte for byte. The output's config then has a group per scheme (the
recipe's and the kept FP8 one) in ``mixed-precision`` format.

A module is kept only where the weight in memory is still exactly the source's dequantized values when its
subgraph is compressed: one that another modifier quantized, pruned or folded scales into is written as that
modifier left it (a log line names it). Sources other than FP8 (MXFP4, compressed-tensors, AWQ, GPTQ) are
refused: their untargeted weights are written dequantized, as without this modifier.

Example (recipe):
    quant_stage:
      quant_modifiers:
        GPTQModifier: {targets: ["re:.*experts.*"], scheme: NVFP4A16, ignore: [lm_head]}
        KeepSourceFormatModifier: {}
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from seqcal.mappings.names import checkpoint_names
from seqcal.modifiers.base import Modifier, QuantizedWeight, RunState
from seqcal.sources.checkpoint import quantized_source
from seqcal.sources.fp8 import Fp8Family, scale_float32, scale_key
from seqcal.tracing.partition import Subgraph

logger = logging.getLogger("seqcal")


@dataclass
class KeepSourceFormatModifier(Modifier):
    """Write every untouched FP8-stored Linear of the source in its FP8 form (module docstring).

    Args:
        source: the quantized checkpoint's directory; None: the model's own (``name_or_path``), as the
            entry point resolved it. Not part of the recipe it writes (a path of this machine).
    """

    own_modules_only: ClassVar[bool] = True  # keeps its modules' stored form, changes nothing else

    name: ClassVar[str] = "KeepSourceFormatModifier"
    source: str | None = field(default=None, repr=False)

    def validate(self, model: torch.nn.Module) -> None:
        """Open the source and find the Linears it stores in FP8.

        Raises:
            ValueError: the model is not read from a checkpoint directory, the checkpoint is not quantized, or
                its format is not FP8 (one sentence, with what to do).
        """
        path = self.source or getattr(model, "name_or_path", None)
        where = f"{self.name}"
        if path and not Path(path).is_dir():  # a Hub id: its snapshot, as the model was read from it
            from seqcal.models import resolve_model

            try:
                path = str(resolve_model(path))
            except ValueError:
                pass
        if not path or not Path(path, "config.json").is_file():
            raise ValueError(f"{where}: the model was not read from a checkpoint directory ({path!r}), so there is "
                             "no stored form to keep; pass the quantized checkpoint's directory as the model")  # fmt: skip
        checkpoint = quantized_source(path)
        if checkpoint is None:
            raise ValueError(f"{where}: {path} holds full-precision weights, so there is no quantized form to keep; "
                             "drop keep_source_format")  # fmt: skip
        if not isinstance(checkpoint.family, Fp8Family):
            raise ValueError(f"{where}: {path} stores its weights as {checkpoint.source.name}; only FP8 sources "
                             "(quant_method fp8: blocks, per tensor or per row) keep their form, others are written "
                             "dequantized: drop keep_source_format")  # fmt: skip
        if checkpoint.source.config.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"{where}: {path}'s FP8 activations are static (activation_scheme "
                             f"{checkpoint.source.config.get('activation_scheme')!r}), whose input scales the "
                             "compressed-tensors form would need; drop keep_source_format")  # fmt: skip
        self._checkpoint = checkpoint
        aliases = checkpoint_names(model)
        # module name -> the stored weight it reads (the checkpoint's name), for the Linears stored in FP8
        self._stored = {
            n: f"{aliases.get(n, n)}.weight"
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and checkpoint.is_quantized(f"{aliases.get(n, n)}.weight")
        }
        if not self._stored:
            raise ValueError(f"{where}: no Linear of {type(model).__name__} is stored in FP8 in {path}; drop "
                             "keep_source_format")  # fmt: skip

    @property
    def stored(self) -> dict[str, str]:
        """Module name -> the checkpoint key of its FP8 weight, for every Linear the source stores in FP8 (after
        ``validate``)."""
        return dict(self._stored)

    @staticmethod
    def check_last(modifiers: list[Modifier]) -> None:
        """It must compress after every other modifier of a subgraph, to see what they quantized or changed."""
        named = [i for i, m in enumerate(modifiers) if isinstance(m, KeepSourceFormatModifier)]
        if named and named != [len(modifiers) - 1]:
            raise ValueError("KeepSourceFormatModifier must be the recipe's last modifier, once: it keeps the FP8 "
                             "form of what the modifiers before it left unchanged")  # fmt: skip

    def modules_in(self, subgraph: Subgraph) -> list[str]:
        return [n for n in self._stored if subgraph.holds(n)]

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        """Record the stored form of each FP8 Linear of ``subgraph`` the other modifiers left unchanged."""
        for name in self.modules_in(subgraph):
            if name in state.results.quantized or name in state.results.sparsity:
                continue  # the recipe's: quantized or pruned by another modifier
            kept, key = self.stored_form(name), self._stored[name]
            weight = model.get_submodule(name).weight
            stored = {key: kept.q, scale_key(key): kept.scale}
            dequantized = self._checkpoint.family.dequantize(key, stored, weight.dtype)
            if not torch.equal(dequantized, weight.detach().to(dequantized.device)):
                logger.info("seqcal: %s: its weight is no longer the source's FP8 values (another modifier "
                            "changed it); written in %s", name, weight.dtype)  # fmt: skip
                continue
            state.results.quantized[name] = kept
        return False

    def stored_form(self, name: str) -> QuantizedWeight:
        """Module ``name``'s FP8 weight and float32 scales as the source stores them, with their scheme."""
        key = self._stored[name]
        q = self._checkpoint.read_stored(key)
        scale = self._checkpoint.read_stored(scale_key(key))
        return QuantizedWeight(q=q, scale=compressed_scale(scale), zero_point=None, g_idx=None,
                               scheme=self.stored_scheme(name))  # fmt: skip

    def stored_scheme(self, name: str) -> QuantizationScheme:
        """The scheme of module ``name``'s stored form, from the checkpoint's headers (``scheme_of``)."""
        key = self._stored[name]
        infos = self._checkpoint.infos
        return self.scheme_of(tuple(infos[key][1]), tuple(infos[scale_key(key)][1]))

    def scheme_of(self, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> QuantizationScheme:
        """compressed-tensors' description of the stored form: FP8 weights per block (with dynamic FP8
        activations per group of the block's width, as DeepSeek runs them), per row or per tensor (activations
        per token)."""
        block = self._checkpoint.family.block
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        # one scale per block (the family checked the grid), else one per tensor or row
        if block is not None and math.prod(scale_shape) > 1:
            weights = QuantizationArgs(**fp8, strategy="block", block_structure=list(block), dynamic=False)
            inputs = QuantizationArgs(**fp8, strategy="group", group_size=block[1], dynamic=True)
        else:
            per_row = len(scale_shape) == 2 and scale_shape[0] == shape[0] and shape[0] > 1
            weights = QuantizationArgs(**fp8, strategy="channel" if per_row else "tensor", dynamic=False)
            inputs = QuantizationArgs(**fp8, strategy="token", dynamic=True)
        return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)

    def to_dict(self) -> dict[str, Any]:
        return {}  # ``source`` is a path of this machine; a replay finds it as the model's own


def compressed_scale(scale: torch.Tensor) -> torch.Tensor:
    """The stored scales as the float32 values they stand for (e8m0 exponent bytes and float8_e8m0fnu included);
    a single scale as compressed-tensors' per-tensor ``[1]``."""
    out = scale_float32(scale)
    return out.reshape(1) if out.numel() == 1 else out
