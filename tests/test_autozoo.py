"""The full architecture zoo (tests/autozoo.py): the generator's rules, and trace equivalence per model type.

``make test`` checks a fixed, deterministic subset of the model types (``SUBSET``); ``SEQCAL_FULL_ZOO=1``
checks every one (see CONTRIBUTING.md, "The full architecture zoo"). A model type in ``KNOWN`` fails
today: its test is ``xfail(strict=True)`` with the failure class and error, so a fix makes it pass,
which fails the run until its entry is removed. ``benchmarks/tracing/full_zoo.py --known`` prints ``KNOWN``
from a full run.
"""

from __future__ import annotations

import os

import pytest
import torch

from autozoo import HEAD_DIM, HIDDEN, VOCAB, build, candidates, shrink, tiny_config
from autozoo_check import STATUSES, Check, check, compare, expected_targets, first_line
from autozoo_known import KNOWN
from zoo import ARCHS

CANDIDATES = candidates()
FULL = os.environ.get("SEQCAL_FULL_ZOO") == "1"
# Every 8th model type not in the hand-written zoo (tests/zoo.py checks those), in name order, leaving out
# the ones whose tiny model does not build or run eagerly (they say nothing about seqcal, and some take
# minutes): about 30 architectures of all families, a few seconds each. The full run checks them all.
SETUP_FAILURES = ("no-tiny-build", "no-eager")
SUBSET = [t for t in CANDIDATES if t not in ARCHS][::8]
SUBSET = [t for t in SUBSET if KNOWN.get(t, ("ok",))[0] not in SETUP_FAILURES]


def _param(model_type: str) -> object:
    known = KNOWN.get(model_type)
    if known is None:
        return model_type
    status, error = known
    return pytest.param(model_type, marks=pytest.mark.xfail(strict=True, reason=f"{status}: {error}"))


def test_auto_mappings_yield_the_architectures() -> None:
    assert len(CANDIDATES) >= 200
    assert {a.family for a in CANDIDATES.values()} == {"decoder", "encoder", "encoder-decoder", "vlm"}
    picked = {t: CANDIDATES[t].class_name for t in ("llama", "bert", "t5", "llava", "gemma3", "bart")}
    assert picked == {
        "llama": "LlamaForCausalLM",
        "bert": "BertForMaskedLM",  # the encoder head, not BertLMHeadModel
        "t5": "T5ForConditionalGeneration",
        "llava": "LlavaForConditionalGeneration",
        "gemma3": "Gemma3ForConditionalGeneration",
        "bart": "BartForConditionalGeneration",  # seq2seq before its causal-LM variant
    }
    # every hand-written zoo architecture is a generated one too (``mllama_text``: mllama's text-only class)
    assert {n if n in CANDIDATES else n.removesuffix("_text") for n in ARCHS} <= set(CANDIDATES)


def test_shrink_sizes_heads_and_ids() -> None:
    config = shrink({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "vocab_size": 32000, "intermediate_size": 11008, "num_hidden_layers": 32,
                     "pad_token_id": 32000, "image_token_id": 151655, "bos_token_id": 1})  # fmt: skip
    assert config == {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "vocab_size": 256, "intermediate_size": 128, "num_hidden_layers": 2,
                      "pad_token_id": 0, "image_token_id": 241, "bos_token_id": 1}  # fmt: skip
    mha = shrink({"num_attention_heads": 32, "num_key_value_heads": 32, "n_head": 12})
    assert mha == {"num_attention_heads": 4, "num_key_value_heads": 4, "n_head": 4}


def test_shrink_keeps_layer_patterns() -> None:
    """Every layer kind survives, and lists indexed by layer follow the new layer count."""
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 4
    config = shrink({"num_hidden_layers": 24, "layer_types": types, "first_k_dense_replace": 1})
    assert config["num_hidden_layers"] == 6 and config["layer_types"] == types[:6]
    mixed = ["linear"] * 11 + ["full"] + ["linear"] * 12
    config = shrink({"num_hidden_layers": 24, "layer_types": mixed, "cross_attention_layers": [3, 8, 13]})
    assert config["layer_types"] == ["linear", "full"] and config["cross_attention_layers"] == [1]
    config = shrink({"num_layers": 30, "attn_layer_period": 8, "attn_layer_offset": 4})
    assert config["num_layers"] == 8
    config = shrink({"num_hidden_layers": 32, "per_layer_config": {3: "a", 11: "b"}})
    assert config["per_layer_config"] == {}


def test_shrink_keeps_size_relations() -> None:
    mla = shrink({"head_dim": 64, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128})
    assert mla == {"head_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": HEAD_DIM}
    ssm = shrink({"hidden_size": 4096, "expand": 2, "num_heads": 128, "head_dim": 64, "n_groups": 8})
    assert ssm["num_heads"] * ssm["head_dim"] == 2 * ssm["hidden_size"] and ssm["n_groups"] == 1
    assert shrink({"hidden_size": 4096, "adapter_in_dim": 4096, "out_size": 10}) == {
        "hidden_size": HIDDEN, "adapter_in_dim": HIDDEN, "out_size": 10}  # fmt: skip
    assert shrink({"projector_size": None, "d_model": 512}) == {"projector_size": None, "d_model": HIDDEN}
    vl = shrink(
        {"vision_config": {}, "text_config": {"head_dim": 128, "rope_parameters": {"rope_type": "x"}}}
    )
    assert sum(vl["text_config"]["rope_parameters"]["mrope_section"]) == HEAD_DIM // 2


def test_tiny_builds_are_tiny_and_seeded() -> None:
    config = tiny_config("qwen3_next")
    assert config.hidden_size == HIDDEN and config.vocab_size == VOCAB
    assert {"linear_attention", "full_attention"} <= set(config.layer_types)
    model = build(CANDIDATES["qwen3_next"])
    assert sum(p.numel() for p in model.parameters()) < 2_000_000 and not model.training
    again = build(CANDIDATES["qwen3_next"])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_expected_targets_counts_called_text_layers() -> None:
    """The oracle: declared layers in module lists, outside the vision tower, called once each."""
    model = build(CANDIDATES["llava"])
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    called, output = expected_targets(model, inputs)
    assert output.logits.shape == (1, 3, VOCAB)
    assert called == [
        f"model.language_model.layers.{i}" for i in range(model.config.text_config.num_hidden_layers)
    ]


def test_expected_targets_without_declared_layers_uses_stack_names() -> None:
    """BioGPT declares no ``_no_split_modules``: its ``layers`` list is the stack."""
    model = build(CANDIDATES["biogpt"])
    assert not model._no_split_modules
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    assert expected_targets(model, inputs)[0] == ["biogpt.layers.0", "biogpt.layers.1"]


def test_compare_flags_differences_and_nan_places() -> None:
    ref = {"logits": torch.tensor([[1.0, float("nan")]])}
    assert compare({"logits": torch.tensor([[1.0, float("nan")]])}, ref) == (0.0, "")
    assert "NaNs" in compare({"logits": torch.tensor([[float("nan"), 1.0]])}, ref)[1]
    assert "max abs diff" in compare({"logits": torch.tensor([[1.1, float("nan")]])}, ref)[1]
    assert "structure" in compare({"x": torch.zeros(1)}, ref)[1]


def test_first_line_keeps_the_cause_after_a_heading() -> None:
    exc = ValueError(
        "Class validation error for 'validate_architecture':\n    ValueError: heads must divide 64"
    )
    assert first_line(exc) == (
        "ValueError: Class validation error for 'validate_architecture': ValueError: heads must divide 64"
    )
    assert first_line(RuntimeError("shape mismatch\nmore")) == "RuntimeError: shape mismatch"


def test_known_failures_are_classified() -> None:
    for model_type, (status, error) in KNOWN.items():
        assert model_type in CANDIDATES, f"KNOWN names {model_type!r}, which the auto mappings no longer hold"
        assert status in STATUSES and status != "ok" and error


@pytest.mark.parametrize("model_type", [_param(t) for t in (list(CANDIDATES) if FULL else SUBSET)])
def test_partitioned_equals_eager(model_type: str) -> None:
    """Traced on batch 1, run on batch 2 with left padding: outputs equal eager, one subgraph per layer + 1."""
    result = check(model_type)
    where = f" ({result.where})" if result.where else ""
    assert result.status == "ok", f"{model_type}: {result.status}: {result.error}{where}"


# ------------------------------------------------------------------------ benchmarks/tracing/full_zoo.py


def _full_zoo() -> object:
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "tracing"))
    return importlib.import_module("full_zoo")


def test_full_zoo_totals_known_and_merge() -> None:
    full_zoo = _full_zoo()
    rows = [
        Check("a", status="ok", count=3, expected=3, seconds=1.0),
        Check("b", status="count-wrong", count=5, expected=3, seconds=2.0),
        Check("c", status="mismatch", count=3, expected=3, error="out.logits: diff", seconds=3.0),
        Check("d", status="no-eager", error="E: x", where="m.py:1", seconds=4.0),
    ]
    sums = full_zoo.totals(rows, 10.0)
    assert sums["run eagerly"] == 3 and sums["silent mismatches"] == 1
    assert sums["outputs equal eager"] == "2/3 (66.7%)" and sums["subgraph count right"] == "2/3 (66.7%)"
    namespace: dict[str, object] = {}
    exec(full_zoo.known(rows), namespace)  # the text pasted into tests/autozoo_known.py
    assert namespace["KNOWN"] == {
        "b": ("count-wrong", ""),
        "c": ("mismatch", "out.logits: diff"),
        "d": ("no-eager", "E: x (m.py:1)"),
    }
    merged = full_zoo._merge(rows, [Check("c", status="ok"), Check("e", status="ok")])
    assert [(r.model_type, r.status) for r in merged][2:] == [("c", "ok"), ("d", "no-eager"), ("e", "ok")]
    assert "| d | " in full_zoo.render(rows, markdown=True, wall=10.0)


def test_full_zoo_runs_each_arch_in_its_own_process() -> None:
    full_zoo = _full_zoo()
    (done,) = full_zoo.run_all(["llama"], jobs=1, timeout=300)
    assert (done.model_type, done.status, done.count, done.expected) == ("llama", "ok", 3, 3)
    (late,) = full_zoo.run_all(["llama"], jobs=1, timeout=0.0)
    assert late.status == "runtime-error" and late.error.startswith("timeout")
