"""SpinQuantModifier: rotations of the residual stream (R1), of each attention head's values (R2) and of the MLP's
down_proj input (R4), with llm-compressor 0.14's arguments and default mappings (Liu et al., 2024).

R1 and R2 are fused into the weights (the float model computes the same function): each norm's weight is first
folded into the Linears it feeds (``W diag(g)``, the norm's weight set to 1; a norm must commute with rotations:
RMSNorm does, LayerNorm's mean and Gemma's ``x * (1 + w)`` do not, and are refused before any weight is read),
then the embeddings' rows, o_proj's and down_proj's outputs are rotated by ``R1`` and every Linear reading the
stream (q/k/v, gate/up, lm_head) by ``R1`` on its input; v_proj's output and o_proj's input by ``R2`` per head.
R4 is online: down_proj's input is rotated at run time (``transform_config``). Tied embeddings are untied (lm_head
gets its own weight). R3 (queries and keys inside attention) is not implemented and refused.

The fold has a cost the rotation does not undo: norm weights that span orders of magnitude (a model turning
channels of massive activations down) make the folded weights' columns that unequal, and round to nearest of them
can lose more than the rotation gains; the run logs such norms (``FAINT`` in ``modifiers/rotations.py``). GPTQ,
whose Hessians weigh each input channel, gains from the rotation there; R2 and R4 fold no norm.

Example:
    >>> SpinQuantModifier(rotations=["R1", "R2"]).rotations
    ['R1', 'R2']
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from seqcal.algorithms.rotations import rotate
from seqcal.mappings.graph import norm_fold_reason
from seqcal.mappings.names import checkpoint_names
from seqcal.modifiers.base import RunState
from seqcal.modifiers.rotations import Edit, RotationModifier
from seqcal.modifiers.schemes import matches_target
from seqcal.tracing.partition import Subgraph

ROTATIONS = ("R1", "R2", "R3", "R4")
# llm-compressor's defaults (its SpinQuantMapping and NormMapping for Llama-like models)
MAPPINGS = {
    "embedding": "re:.*embed_tokens$", "attn": "re:.*self_attn$", "attn_q": "re:.*q_proj$",
    "attn_k": "re:.*k_proj$", "attn_v": "re:.*v_proj$", "attn_o": "re:.*o_proj$", "attn_head_dim": None,
    "mlp_in": ["re:.*up_proj$", "re:.*gate_proj$"], "mlp_out": ["re:.*down_proj$"], "lm_head": "lm_head",
}  # fmt: skip
NORM_MAPPINGS = [
    {"norm": "re:.*input_layernorm$", "linears": ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]},
    {"norm": "re:.*post_attention_layernorm$", "linears": ["re:.*up_proj$", "re:.*gate_proj$"]},
    {"norm": "model.norm", "linears": ["lm_head"]},
]


def _listed(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _mappings_from(groups: dict[str, Any]) -> dict[str, Any]:
    """The SpinQuantMapping fields a transform_config's targets name, laid out as ``transform_groups`` writes them
    (R1: [embedding, attn_o, *mlp_out] -> [attn_q, attn_k, attn_v, *mlp_in, lm_head]; R2: attn_v -> attn_o; R4:
    mlp_out). A layout that does not fit gives nothing here; the comparison after the plan then names the field."""

    def targets(group: str, i: int) -> list[str]:
        apply = groups.get(group, {}).get("apply") or []
        return list(apply[i].get("targets") or []) if len(apply) > i else []

    found: dict[str, Any] = {}
    if len(outputs := targets("R1", 0)) >= 3:
        found.update(embedding=outputs[0], attn_o=outputs[1], mlp_out=outputs[2:])
    if len(inputs := targets("R1", 1)) >= 5:
        found.update(
            attn_q=inputs[0], attn_k=inputs[1], attn_v=inputs[2], mlp_in=inputs[3:-1], lm_head=inputs[-1]
        )
    if len(v := targets("R2", 0)) == 1 and len(o := targets("R2", 1)) == 1:
        found.update(attn_v=v[0], attn_o=o[0])
    if mlp_out := targets("R4", 0):
        found["mlp_out"] = mlp_out
    return found


def _layer(name: str) -> str | None:
    """The layer index in a module name (``model.layers.3.input_layernorm`` -> "3"), None outside the layers."""
    found = re.search(r"\.(\d+)\.", f".{name}.")
    return found.group(1) if found else None


def rotation_reason(module: torch.nn.Module) -> str | None:
    """Why a norm does not commute with rotations once its weight is 1 (``norm(x R) = norm(x) R``), or None.

    Checked on the module's own forward with probe parameters (its weights may be on meta); then its weight must
    fold into the next Linears (``mappings.graph.norm_fold_reason``: Gemma's ``x * (1 + w)`` does not).
    """
    if getattr(module, "bias", None) is not None:
        return f"{type(module).__name__} has a bias, which does not commute with a rotation"
    d = module.weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, d, generator=gen) + 0.5  # [2, 3, d], a mean that LayerNorm would remove
    r, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))  # an orthogonal [d, d]
    buffers = {n: b.float() for n, b in module.named_buffers() if b.device.type != "meta"}
    params = {n: torch.ones(p.shape) for n, p in module.named_parameters()}
    try:
        with torch.no_grad():
            y = torch.func.functional_call(module, {**buffers, **params}, (x,))
            y_r = torch.func.functional_call(module, {**buffers, **params}, (x @ r,))
    except Exception as exc:  # noqa: BLE001 - a norm that cannot be probed cannot be rotated through
        return f"{type(module).__name__} could not be checked ({type(exc).__name__}: {exc})"
    if not isinstance(y, torch.Tensor) or not torch.allclose(y_r, y @ r, rtol=1e-4, atol=1e-4):
        return f"{type(module).__name__} does not commute with rotations (it is no RMSNorm)"
    return norm_fold_reason(module)


@dataclass
class SpinQuantModifier(RotationModifier):
    """SpinQuant's rotations as llm-compressor 0.14's SpinQuantModifier (Hadamard, not learned).

    Args:
        rotations: any of "R1" (residual stream), "R2" (per attention head, v_proj -> o_proj), "R4" (down_proj's
            input, online); "R3" is refused.
        mappings: llm-compressor's SpinQuantMapping as a dict (embedding, attn_q, attn_k, attn_v, attn_o,
            attn_head_dim, mlp_in, mlp_out, lm_head); None: the Llama defaults (``MAPPINGS``).
        norm_mappings: a list of ``{norm: pattern, linears: [patterns]}``; None: the Llama defaults.
        transform_type, randomize, learnable, precision, transform_block_size, transform_config: see
            ``RotationModifier`` (the block size applies to R1 and R4; R2 uses the head size).
    """

    name: ClassVar[str] = "SpinQuantModifier"
    rotations: list[str] = field(default_factory=lambda: ["R1", "R2"])
    mappings: Any = None
    norm_mappings: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rotations = [str(r).upper() for r in _listed(self.rotations)]
        if not self.rotations or any(r not in ROTATIONS for r in self.rotations):
            raise ValueError(
                f"{self.name}: rotations must be a non-empty list of R1, R2, R4, got {self.rotations!r}"
            )
        if "R3" in self.rotations:
            raise ValueError(f"{self.name}: rotation R3 (queries and keys inside attention) is not implemented in "
                             "seqcal; remove it from rotations")  # fmt: skip
        if self.mappings is not None and not isinstance(self.mappings, dict):
            raise ValueError(
                f"{self.name}: mappings must be a dict of SpinQuantMapping fields, got {self.mappings!r}"
            )
        if unknown := set(self.mappings or {}) - set(MAPPINGS):
            raise ValueError(
                f"{self.name}: unknown mappings keys {sorted(unknown)}; valid: {', '.join(MAPPINGS)}"
            )
        norms = self.norm_mappings
        if norms is not None and (not isinstance(norms, list) or any(not isinstance(n, dict) or set(n) != {"norm", "linears"} for n in norms)):  # fmt: skip
            raise ValueError(
                f"{self.name}: norm_mappings must be a list of {{norm: pattern, linears: [patterns]}}"
            )
        self._maps = {**MAPPINGS, **(self.mappings or {})}
        self._untie: str | None = (
            None  # lm_head's weight tied to the embeddings on meta: copied in subgraph 0
        )
        self._embedding: torch.Tensor | None = None  # E R, until lm_head is rotated

    def arguments_from(self, groups: dict[str, Any]) -> dict[str, Any]:
        if unknown := [g for g in groups if g not in ("R1", "R2", "R4")]:
            raise ValueError(f"{self.name}: transform_config.config_groups.{unknown[0]} is not a rotation seqcal "
                             "builds (R1, R2, R4; R3 is not implemented): remove it")  # fmt: skip
        found = _mappings_from(groups)
        current = {**MAPPINGS, **(self.mappings if isinstance(self.mappings, dict) else {})}
        block = (groups.get("R1") or groups.get("R4") or {}).get("head_dim")
        args: dict[str, Any] = {"rotations": list(groups), "transform_block_size": block}
        if changed := {k: v for k, v in found.items() if v != current[k]}:
            args["mappings"] = {
                **(self.mappings or {}),
                **changed,
            }  # llm-compressor saves no mappings beside it
        return args

    # --- the plan -------------------------------------------------------------------------------------------
    def _match(self, model: torch.nn.Module, patterns: Any, role: str, required: bool = True) -> list[str]:
        aliases = checkpoint_names(model)
        names = [
            n for n, m in model.named_modules() if matches_target(m, n, _listed(patterns), aliases.get(n))
        ]
        if required and not names:
            raise ValueError(f"{self.name}: mapping {role}={patterns!r} matches no module of {type(model).__name__}; "
                             "give mappings for this architecture")  # fmt: skip
        return names

    def plan(self, model: torch.nn.Module) -> list[Edit]:
        m, edits = self._maps, []
        config = model.config.get_text_config() if hasattr(model, "config") else None
        hidden = getattr(config, "hidden_size", None)
        q, k, v, o = (self._match(model, m[f"attn_{p}"], f"attn_{p}") for p in "qkvo")
        mlp_in, mlp_out = (
            self._match(model, m["mlp_in"], "mlp_in"),
            self._match(model, m["mlp_out"], "mlp_out"),
        )
        if "R1" in self.rotations:
            size = self.transform_block_size or hidden
            embed, head = (
                self._match(model, m["embedding"], "embedding"),
                self._match(model, m["lm_head"], "lm_head"),
            )
            outputs, inputs = [*embed, *o, *mlp_out], [*q, *k, *v, *mlp_in, *head]
            edits += [Edit(n, "weight_output", "R1", size) for n in outputs]
            edits += [Edit(n, "weight_input", "R1", size) for n in inputs]
            self._plan_norms(model, inputs)
            self._check_widths(model, edits, hidden)
        if "R2" in self.rotations:
            head_dim = (
                m["attn_head_dim"]
                or getattr(config, "head_dim", None)
                or hidden // config.num_attention_heads
            )
            edits += [Edit(n, "weight_output", "R2", head_dim) for n in v]
            edits += [Edit(n, "weight_input", "R2", head_dim) for n in o]
        if "R4" in self.rotations:
            for n in mlp_out:
                size = self.transform_block_size or model.get_submodule(n).in_features
                edits += [Edit(n, "weight_input", "R4", size), Edit(n, "input", "R4", size)]
        return edits

    def _check_widths(self, model: torch.nn.Module, edits: list[Edit], hidden: int | None) -> None:
        for e in edits:
            module = model.get_submodule(e.module)
            width = module.weight.shape[1 if e.location == "weight_input" or isinstance(module, torch.nn.Embedding)
                                        else 0]  # fmt: skip
            if width != hidden or width % e.size:
                raise ValueError(f"{self.name}: {e.module} has width {width} on the residual stream side, not the "
                                 f"hidden size {hidden} (or not a multiple of {e.size}); give mappings that name "
                                 "only the modules reading or writing the residual stream")  # fmt: skip

    def _plan_norms(self, model: torch.nn.Module, consumers: list[str]) -> None:
        """Each norm with the Linears it feeds in its layer; every R1 input Linear must be fed by one."""
        self._norms, covered = [], set()
        for mapping in self.norm_mappings if self.norm_mappings is not None else NORM_MAPPINGS:
            linears = self._match(model, mapping["linears"], "norm_mappings.linears", required=False)
            for norm in self._match(model, mapping["norm"], "norm_mappings.norm", required=False):
                mine = [n for n in linears if _layer(n) == _layer(norm)]
                if reason := rotation_reason(model.get_submodule(norm)):
                    raise ValueError(f"{self.name}: {norm} cannot be folded into {', '.join(mine) or 'its Linears'} "
                                     f"for rotation R1: {reason}; use rotations [R2] or [R4] for this model")  # fmt: skip
                self._norms.append((norm, mine))
                covered.update(mine)
        if missing := [n for n in consumers if n not in covered]:
            raise ValueError(f"{self.name}: {missing[0]} reads the residual stream but no norm_mappings entry names the "
                             "norm before it, so R1 would change the model; give norm_mappings")  # fmt: skip

    # --- tied embeddings ------------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> None:
        if "R1" not in self.rotations:
            return
        (embed,) = self._match(model, self._maps["embedding"], "embedding")[:1]
        for head in self._match(model, self._maps["lm_head"], "lm_head"):
            weight = model.get_submodule(head).weight
            if weight is not model.get_submodule(embed).weight:
                continue
            if weight.device.type == "meta":  # offloaded: its value is read with the embeddings (subgraph 0)
                self._untie = head
                fresh = torch.empty_like(weight, device="meta")
            else:
                fresh = weight.detach().clone()
            model.get_submodule(head).weight = torch.nn.Parameter(fresh, requires_grad=False)
            for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
                config.tie_word_embeddings = False
            tied = getattr(model, "all_tied_weights_keys", None)  # transformers' record, read when saving
            if isinstance(tied, dict):
                tied.pop(f"{head}.weight", None)

    def _apply(self, subgraph: Subgraph, model: torch.nn.Module, state: Any) -> bool:
        head = self._untie
        if head and subgraph.holds(head) and head not in self._done and self._embed() in self._done:
            self._restore_head(model)  # its store value is the rotated embeddings by now
        changed = super()._apply(subgraph, model, state)
        self._stash(subgraph, model)
        return changed

    def replayed(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> None:
        super().replayed(subgraph, model, state)
        self._stash(subgraph, model)

    def _embed(self) -> str:
        return next(e.module for e in self._edits if e.scheme == "R1" and e.location == "weight_output")

    def _stash(self, subgraph: Subgraph, model: torch.nn.Module) -> None:
        """Offloaded tied lm_head: keep the rotated embeddings ``E R`` (as saved, so a resumed run has the same)."""
        if (
            self._untie
            and self._embedding is None
            and subgraph.holds(self._embed())
            and self._embed() in self._done
        ):
            self._embedding = model.get_submodule(self._embed()).weight.detach().to("cpu", copy=True)

    def _restore_head(self, model: torch.nn.Module) -> None:
        """lm_head's weight ``E = (E R) R^T`` from the stashed rotated embeddings, before its own fold and R1."""
        if self._embedding is None:
            raise RuntimeError(f"{self.name}: {self._untie} runs before the embeddings it is tied to")
        h = next(self._matrices[(e.scheme, e.size)] for e in self._edits if e.module == self._embed())
        weight = model.get_submodule(self._untie).weight
        with torch.no_grad():
            weight.copy_(rotate(self._embedding.to(torch.float64), h.T).to(weight.dtype))
        self._embedding = None

    # --- the checkpoint -------------------------------------------------------------------------------------
    def transform_groups(self, model: torch.nn.Module) -> dict[str, Any]:
        m, groups = self._maps, {}
        if "R1" in self.rotations:
            groups["R1"] = self.scheme_json([
                {"targets": [m["embedding"], m["attn_o"], *_listed(m["mlp_out"])], "location": "weight_output"},
                {"targets": [m["attn_q"], m["attn_k"], m["attn_v"], *_listed(m["mlp_in"]), m["lm_head"]],
                 "location": "weight_input", "inverse": True},
            ], self.transform_block_size)  # fmt: skip
        if "R2" in self.rotations:
            head_dim = next(e.size for e in self._edits if e.scheme == "R2")
            groups["R2"] = self.scheme_json([
                {"targets": [m["attn_v"]], "location": "weight_output"},
                {"targets": [m["attn_o"]], "location": "weight_input", "inverse": True},
            ], head_dim)  # fmt: skip
        if "R4" in self.rotations:
            groups["R4"] = self.scheme_json([
                {"targets": _listed(m["mlp_out"]), "location": "input"},
                {"targets": _listed(m["mlp_out"]), "location": "weight_input", "inverse": True},
            ], self.transform_block_size)  # fmt: skip
        return groups
