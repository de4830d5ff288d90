"""Hadamard rotations: the matrices (compressed-tensors' conventions), QuIP and SpinQuant keeping the float model's
function, their checkpoints reloading with the logits of seqcal's model, the combinations with RTN, GPTQ and AWQ,
and the errors before calibration (a width that cannot be rotated, a norm that cannot be folded)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from seqcal import GPTQModifier, QuantizationModifier, oneshot
from seqcal.algorithms.rotations import (
    hadamard_matrix,
    rotate,
    rotate_weight_input,
    rotate_weight_output,
    supported,
)
from seqcal.evaluation.loading import load_causal_lm
from seqcal.modifiers import QuIPModifier, SpinQuantModifier
from seqcal.modifiers.awq import AWQModifier
from zoo import ARCHS

INT4 = {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                "strategy": "group", "group_size": 16}}}  # fmt: skip


def _llama(tie: bool = False, hidden: int = 64) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tie)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        for p in model.parameters():
            if p.dim() == 1:  # norms away from 1, so that folding them is exercised
                p.data.uniform_(0.5, 1.5)
    return model


def _data() -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(3, 250, (16,), generator=gen).tolist()} for _ in range(4)]


IDS = torch.tensor([row["input_ids"] for row in _data()[:2]])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


# --- the math ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("size", "kind"), [(16, "hadamard"), (576, "hadamard"), (576, "random-hadamard")])
def test_hadamard_matrices_are_orthogonal(size: int, kind: str) -> None:
    h = hadamard_matrix(size, kind, torch.Generator().manual_seed(0))
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, size * torch.eye(size, dtype=h.dtype))


def test_which_orders_exist() -> None:
    assert supported(64, "hadamard") and not supported(576, "hadamard") and not supported(48, "hadamard")
    assert supported(576, "hadamard", kronecker=True) and supported(1536, "random-hadamard")


def test_fused_rotations_equal_compressed_tensors() -> None:
    """Our W R, R^T W and R^T b are what compressed-tensors' apply_transform_config fuses (deterministic type)."""
    from compressed_tensors.transform import (
        TransformArgs,
        TransformConfig,
        TransformScheme,
        apply_transform_config,
    )

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(32, 16))
    w, b = layer[0].weight.detach().clone(), layer[0].bias.detach().clone()
    for location, inverse in (("weight_input", True), ("weight_output", False)):
        copy = torch.nn.Sequential(torch.nn.Linear(32, 16))
        copy.load_state_dict(layer.state_dict())
        args = TransformArgs(targets=["Linear"], location=location, inverse=inverse)
        apply_transform_config(copy, TransformConfig(config_groups={"g": TransformScheme(type="hadamard", head_dim=8,
                                                                                        apply=[args])}))  # fmt: skip
        h = hadamard_matrix(8, "hadamard")
        want = rotate_weight_input(w, h) if location == "weight_input" else rotate_weight_output(w, h)
        assert torch.allclose(copy[0].weight, want, atol=1e-6)
        if location == "weight_output":
            assert torch.allclose(copy[0].bias, rotate_weight_output(b, h), atol=1e-6)


def test_a_rotation_spreads_an_outlier_column_and_lowers_the_rounding_error() -> None:
    from seqcal.algorithms.quant import compute_qparams, fake_quantize

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=gen)
    w[:, 3] *= 30  # one outlier input channel
    h = hadamard_matrix(64, "hadamard")
    x = torch.randn(256, 64, generator=gen)

    def rounded(m: torch.Tensor) -> torch.Tensor:
        scale, zero = compute_qparams(
            m.amin(1, keepdim=True), m.amax(1, keepdim=True), num_bits=4, symmetric=True
        )
        return fake_quantize(m, scale, zero, num_bits=4)  # per output channel

    plain = (x @ rounded(w).T - x @ w.T).norm()
    rotated = (rotate(x, h) @ rounded(rotate_weight_input(w, h)).T - x @ w.T).norm()
    assert rotated < 0.5 * plain


# --- QuIP --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quip_keeps_the_float_function(arch: str) -> None:
    model = ARCHS[arch].build()
    before = _logits(model)
    oneshot(model=model, dataset=_data(), recipe=QuIPModifier(rotations=["v", "u"], transform_block_size=16))
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, ARCHS[arch].build().model.layers[0]
                           .self_attn.q_proj.weight)  # fmt: skip
    assert (_logits(model) - before).abs().max() <= 1e-5 * before.abs().max()


@pytest.mark.parametrize("quantizer", ["rtn", "gptq"])
def test_quip_checkpoint_reloads_with_the_logits_of_seqcals_model(tmp_path: Path, quantizer: str) -> None:
    cls = QuantizationModifier if quantizer == "rtn" else GPTQModifier
    recipe = [
        QuIPModifier(rotations=["v", "u"], transform_type="hadamard"),
        cls(config_groups=INT4, ignore=["lm_head"]),
    ]
    model = oneshot(model=_llama(), dataset=_data(), recipe=recipe, output_dir=str(tmp_path / "out"))
    block = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert set(block["transform_config"]["config_groups"]) == {"u", "v"}
    loaded = load_causal_lm(tmp_path / "out", torch.float32)
    assert hasattr(loaded.model.layers[0].self_attn.q_proj, "v_input")  # compressed-tensors' online rotation
    got, want = _logits(loaded), _logits(model)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    fp = _logits(_llama())
    assert (got - fp).abs().max() > 1e-3  # the weights were quantized


# --- SpinQuant ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_spinquant_fused_rotations_reload_as_the_float_model(tmp_path: Path, tie: bool) -> None:
    """R1 and R2 (norms folded, tied embeddings untied) leave the float function; from a directory the weights are
    offloaded, so the untying happens on meta; the checkpoint loads in plain transformers."""
    from transformers import AutoModelForCausalLM

    _llama(tie).save_pretrained(tmp_path / "model")
    want = _logits(_llama(tie))
    oneshot(model=str(tmp_path / "model"), dataset=_data(), recipe=SpinQuantModifier(rotations=["R1", "R2"]),
            output_dir=str(tmp_path / "out"))  # fmt: skip
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert not loaded.config.tie_word_embeddings
    assert torch.equal(loaded.model.layers[1].input_layernorm.weight, torch.ones(64))
    assert (_logits(loaded) - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("faint", [False, True])
def test_spinquant_says_when_a_folded_norm_spans_orders_of_magnitude(tmp_path: Path, faint: bool) -> None:
    """A norm whose weights span more than 100x (a channel of massive activations the model turns down), folded
    into the Linears after it, can cost round to nearest more than the rotation gains: the run says so, and only
    then."""
    model = _llama()
    if faint:
        model.model.layers[1].post_attention_layernorm.weight.data[5] = 1e-4
    oneshot(model=model, dataset=_data(), output_dir=str(tmp_path / "out"),
            recipe=[SpinQuantModifier(), QuantizationModifier(config_groups=INT4, ignore=["lm_head"])])  # fmt: skip
    log = json.loads((tmp_path / "out" / "quantization_report.json").read_text())["log"]
    notes = [line for line in log if "may lose more than the rotation gains" in line]
    if faint:
        assert len(notes) == 1 and "1 norm(s)" in notes[0], log
        assert "model.layers.1.post_attention_layernorm: smallest 0.0001 against" in notes[0], notes
    else:
        assert not notes, notes


def test_spinquant_r4_is_online_and_reloads(tmp_path: Path) -> None:
    model = oneshot(model=_llama(), dataset=_data(), output_dir=str(tmp_path / "out"),
                    recipe=[SpinQuantModifier(rotations=["R1", "R2", "R4"]),
                            QuantizationModifier(config_groups=INT4, ignore=["lm_head"])])  # fmt: skip
    block = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert block["transform_config"]["config_groups"]["R4"]["apply"][0]["location"] == "input"
    loaded = load_causal_lm(tmp_path / "out", torch.float32)
    got, want = _logits(loaded), _logits(model)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_online_rotations_alone_are_written_and_reload(tmp_path: Path) -> None:
    # no quantizer: the checkpoint still carries transform_config, or it would load without R4 (silently wrong)
    model = oneshot(model=_llama(), dataset=_data(), output_dir=str(tmp_path / "out"),
                    recipe=[SpinQuantModifier(rotations=["R1", "R2", "R4"])])  # fmt: skip
    block = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert block["transform_config"]["config_groups"]["R4"]["apply"][0]["location"] == "input"
    got, want = _logits(load_causal_lm(tmp_path / "out", torch.float32)), _logits(model)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_spinquant_then_awq_reloads_with_the_logits_of_seqcals_model(tmp_path: Path) -> None:
    recipe = [SpinQuantModifier(), AWQModifier(config_groups=INT4, ignore=["lm_head"], n_grid=4)]
    model = oneshot(model=_llama(), dataset=_data(), recipe=recipe, output_dir=str(tmp_path / "out"))
    got, want = _logits(load_causal_lm(tmp_path / "out", torch.float32)), _logits(model)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_online_rotations_refuse_a_smoothing_fold() -> None:
    recipe = [QuIPModifier(), AWQModifier(config_groups=INT4, ignore=["lm_head"], n_grid=4)]
    with pytest.raises(ValueError, match="rotated online"):
        oneshot(model=_llama(), dataset=_data(), recipe=recipe)


# --- errors ------------------------------------------------------------------------------------------------
def _refused(model: torch.nn.Module, recipe: list, match: str) -> str:
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=match) as err:
        oneshot(model=model, dataset=_data(), recipe=recipe)
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())  # refused before any edit
    message = str(err.value)
    assert not re.search(r"\w\w\. [A-Z]", message) and "\n" not in message  # one sentence
    return message


def test_a_width_it_cannot_rotate_is_refused_before_calibration() -> None:
    message = _refused(_llama(hidden=48), [QuIPModifier(transform_type="hadamard")], "order 48")
    assert "model.layers.0.self_attn.q_proj" in message and "transform_block_size" in message
    _refused(_llama(), [QuIPModifier(transform_block_size=24)], "does not divide")


def test_a_norm_it_cannot_fold_is_refused_before_calibration() -> None:
    message = _refused(ARCHS["gemma"].build(), [SpinQuantModifier()], "cannot be folded")
    assert "input_layernorm" in message and "[R2]" in message


def test_rotating_after_the_quantizer_is_refused() -> None:
    recipe = [QuantizationModifier(config_groups=INT4, ignore=["lm_head"]), QuIPModifier()]
    with pytest.raises(ValueError, match="before the quantizing modifiers"):
        oneshot(model=_llama(), dataset=_data(), recipe=recipe)


@pytest.mark.parametrize(("cls", "kwargs", "match"), [
    (QuIPModifier, {"learnable": True}, "learnable=True is not implemented"),
    (QuIPModifier, {"randomize": True}, "randomize=True is not implemented"),
    (QuIPModifier, {"transform_type": "random-matrix"}, "'random-matrix' is not implemented"),
    (QuIPModifier, {"rotations": ["w"]}, "rotations must be"),
    (QuIPModifier, {"transform_config": {"config_groups": {}}}, "transform_config.config_groups is empty"),
    (SpinQuantModifier, {"transform_config": {"config_groups": {"R3": {"type": "hadamard", "apply": []}}}},
     "transform_config.config_groups.R3 is not a rotation seqcal builds"),
    (SpinQuantModifier, {"rotations": ["R1", "R3"]}, "R3 .* is not implemented"),
    (SpinQuantModifier, {"mappings": {"attn_x": "q"}}, "unknown mappings keys"),
])  # fmt: skip
def test_what_is_not_implemented_is_refused(cls: type, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


class _Interrupted(Exception):
    pass


def test_an_interrupted_rotated_run_resumes_to_the_same_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rotated weights and folded norms of the finished subgraphs are restored, their online rotations hooked
    again (``replayed``), and the rest rotated as in the uninterrupted run: the same bytes."""
    import seqcal.checkpoint.streaming as streaming
    from save_helpers import checkpoint_tensors

    _llama(tie=True).save_pretrained(tmp_path / "model")
    recipe = [
        SpinQuantModifier(rotations=["R1", "R2", "R4"]),
        GPTQModifier(config_groups=INT4, ignore=["lm_head"]),
    ]
    run = {"model": str(tmp_path / "model"), "dataset": _data(), "recipe": recipe}
    oneshot(output_dir=str(tmp_path / "clean"), **run)
    monkeypatch.setattr(streaming, "CHECKPOINT_BYTES", 1)  # progress recorded after every subgraph
    done, calls = streaming.StreamingCheckpoint.done, []

    def dies_after_two(self: streaming.StreamingCheckpoint, sg: object) -> None:
        done(self, sg)
        calls.append(sg)
        if len(calls) == 2:  # the embeddings and layer 0 rotated, layer 1 and the head not yet
            raise _Interrupted

    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", dies_after_two)
    with pytest.raises(_Interrupted):
        oneshot(
            output_dir=str(tmp_path / "killed"), **{**run, "recipe": [type(m)(**m.to_dict()) for m in recipe]}
        )
    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", done)
    oneshot(output_dir=str(tmp_path / "killed"), resume=True, **{**run, "recipe": [type(m)(**m.to_dict())
                                                                                  for m in recipe]})  # fmt: skip
    a, b = checkpoint_tensors(tmp_path / "killed"), checkpoint_tensors(tmp_path / "clean")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
