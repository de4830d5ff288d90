"""How a model's in-memory state-dict keys become checkpoint keys, as transformers' ``save_pretrained`` names them.

Tied weights are written once (``lm_head.weight`` tied to the embeddings is skipped, and a module owning a
tied weight cannot be quantized alone); transformers' weight conversions are reverted (fused MoE experts back
to per-expert tensors, renamed prefixes back to the original names), so a module has its checkpoint names
besides its in-memory one. The writer names tensors with it, ``config.json``'s targets and ignore list name
modules with it.

Example:
    >>> layout = ModelLayout.from_model(model)  # doctest: +SKIP
    >>> layout.checkpoint_names("model.layers.0.mlp.experts.3.down_proj")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

Revert = Callable[[dict[str, Tensor]], dict[str, Tensor]]


@dataclass(frozen=True)
class ModelLayout:
    """How in-memory state-dict keys become checkpoint keys (transformers' save_pretrained conventions).

    Attributes:
        skip: keys not written: tied copies (``lm_head.weight`` when tied to the embeddings) and
            ``_keys_to_ignore_on_save``.
        tied_modules: modules owning a tied weight (quantizing one would also change the other).
        revert: transformers' ``revert_weight_conversion`` bound to the model (fused MoE experts back to
            per-expert tensors, renamed prefixes back to the original names), or None.
    """

    skip: frozenset[str] = frozenset()
    tied_modules: frozenset[str] = frozenset()
    revert: Revert | None = None

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelLayout:
        """Read tied weights and weight conversions from a (transformers) model.

        Args:
            model: the model; tied weights must share their tensor, as ``tie_weights`` leaves them.

        Returns:
            The layout.

        Example:
            >>> CheckpointWriter("out", layout=ModelLayout.from_model(model))  # doctest: +SKIP
        """
        skip = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
        tied_modules = set()
        for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
            t, s = _tensor_or_none(model, target), _tensor_or_none(model, source)
            if t is None or s is None:
                continue
            # offloaded (meta) tensors cannot be compared: trust the config, as save_pretrained does
            if (
                t is not s
                and not (t.is_meta or s.is_meta)
                and (t.data_ptr(), t.shape) != (s.data_ptr(), s.shape)
            ):
                raise ValueError(
                    f"save: the config ties {target} to {source} but they are different tensors, so a reload "
                    "would overwrite one with the other; set model.config.tie_word_embeddings = False"
                )
            skip.add(target)
            tied_modules.update((target.rpartition(".")[0], source.rpartition(".")[0]))
        revert = None
        if hasattr(model, "config") and hasattr(model, "all_tied_weights_keys"):  # a PreTrainedModel
            from transformers.core_model_loading import revert_weight_conversion

            revert = partial(revert_weight_conversion, model)
        return cls(frozenset(skip), frozenset(tied_modules), revert)

    def check_quantizable(self, name: str) -> None:
        """Raise if module ``name`` owns a tied weight: quantizing it changed the tied weight too."""
        if name in self.tied_modules:
            raise ValueError(
                f"save: {name!r} was quantized but its weight is tied to another module's (e.g. lm_head to the "
                "embeddings), which quantizing changed too; add it to `ignore`, or untie before quantizing"
            )

    def checkpoint_names(self, module_name: str) -> list[str]:
        """Names a module has in the checkpoint: its in-memory name, and the reverted one if different."""
        if self.revert is None:
            return [module_name]
        keys = self.revert({f"{module_name}.weight": torch.empty(0, device="meta")})
        return list(dict.fromkeys([module_name, *(k.removesuffix(".weight") for k in keys)]))


def _tensor_or_none(model: torch.nn.Module, key: str) -> Tensor | None:
    module_name, _, attr = key.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    return module._parameters.get(attr, module._buffers.get(attr))
