"""AutoRoundModifier: the learned rounding starts at round to nearest and beats it on every layer's output, the
checkpoint reloads to the model oneshot returned, a stopped run resumes to the same checkpoint, and bad arguments
or schemes it cannot learn are refused before calibrating."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import seqcal.checkpoint.streaming as streaming
from save_helpers import checkpoint_tensors, reload
from seqcal.algorithms import fake_quantize, weight_qparams
from seqcal.algorithms.autoround import (
    LearnedQuantizer,
    RoundingParams,
    learned_codes,
    learned_fake_quantize,
    sign_step_,
)
from seqcal.algorithms.quant import dequantize
from seqcal.entrypoint import oneshot
from seqcal.errors import SeqcalError
from seqcal.modifiers import AutoRoundModifier, QuantizationModifier
from seqcal.modifiers.layer_calls import Calls
from seqcal.recipe.parse import parse_recipe

VOCAB, GROUP = 128, 16
SYM = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": GROUP}}}  # fmt: skip


def tiny_llama(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def data(n: int = 8, length: int = 32, seed: int = 1) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (torch.randint(-3, 4, (length,), generator=g).cumsum(0) % VOCAB).tolist()} for _ in range(n)]  # fmt: skip


def layer_errors(model: torch.nn.Module, reference: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    """Each layer's output error, quantized against full precision, on the full-precision layer's inputs."""
    calls: list[tuple] = []
    handles = [layer.register_forward_pre_hook(lambda m, a, k: calls.append((a, k)), with_kwargs=True)
               for layer in reference.model.layers]  # fmt: skip
    with torch.no_grad():
        reference(ids)
        for h in handles:
            h.remove()
        errors = []
        for (args, kwargs), fp, q in zip(calls, reference.model.layers, model.model.layers, strict=True):
            want, got = fp(*args, **kwargs), q(*args, **kwargs)
            want, got = (v[0] if isinstance(v, tuple) else v for v in (want, got))
            errors.append(float((got - want).pow(2).mean() / want.pow(2).mean()))
    return errors


def full_range_rtn(W: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Symmetric round to nearest over the whole code range (auto-round's): the group's wider side is the lowest code."""
    Wg = W.unflatten(-1, (-1, group))
    lo, hi = Wg.amin(-1, keepdim=True).clamp(max=0), Wg.amax(-1, keepdim=True).clamp(min=0)
    s = torch.where(-lo > hi, -lo, -hi) / 2 ** (bits - 1)
    return ((Wg / s).round().clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * s).flatten(-2)


@pytest.mark.parametrize("symmetric", [True, False])
def test_the_start_is_round_to_nearest_and_the_codes_match_the_fake_quantized_weight(symmetric: bool) -> None:
    W = torch.randn(8, 64) * torch.rand(8, 1) * 3
    p = RoundingParams.start(W, GROUP)
    kw = {"num_bits": 4, "symmetric": symmetric, "group_size": GROUP}
    if symmetric:  # the whole code range, as auto-round
        rtn = full_range_rtn(W, 4, GROUP)
    else:  # compressed-tensors' round to nearest
        s, z = weight_qparams(W, num_bits=4, symmetric=False, strategy="group", group_size=GROUP)
        rtn = fake_quantize(W, s, z, num_bits=4, group_size=GROUP)
    torch.testing.assert_close(learned_fake_quantize(W, p, **kw).detach(), rtn, rtol=0, atol=1e-6)
    with torch.no_grad():  # elsewhere in their ranges: the checkpoint's codes give the weights the search saw
        p.V.uniform_(-0.5, 0.5), p.alpha.uniform_(0.5, 1), p.beta.uniform_(0.5, 1)
    q, scale, zp = learned_codes(W, p, **kw)
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    torch.testing.assert_close(
        dequantize(q, scale, zp, group_size=GROUP), learned_fake_quantize(W, p, **kw).detach()
    )


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("bits", "group"), [(4, GROUP), (2, GROUP), (3, None), (8, GROUP)])
def test_the_fused_fake_quantization_gives_autograds_values_and_gradients(
    symmetric: bool, bits: int, group: int | None
) -> None:
    torch.manual_seed(bits)
    W = torch.randn(24, 64) * torch.rand(24, 1) * 3
    W[0], W[1, :GROUP] = 0.0, 0.5  # an all-zero row and a constant group: the scale's guard and max's tie
    p = RoundingParams.start(W, group)
    with torch.no_grad():  # past the clamps too: alpha / beta out of [0, 1] get no gradient
        p.V.uniform_(-0.5, 0.5), p.alpha.uniform_(0.3, 1.0), p.beta.uniform_(0.3, 1.2)
    G = torch.randn(24, 64)
    kw = {"num_bits": bits, "symmetric": symmetric, "group_size": group}
    want = learned_fake_quantize(W, p, **kw)
    (want * G).sum().backward()
    grads = [t.grad.clone() for t in p.tensors()]
    for t in p.tensors():
        t.grad = None
    got = LearnedQuantizer.of(W, **kw)(p)
    (got * G).sum().backward()
    assert torch.equal(got, want)  # bit for bit: the codes learned_codes stores are the ones searched
    for name, a, b in zip("V alpha beta".split(), grads, [t.grad for t in p.tensors()], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * float(a.abs().max()), msg=name)
        assert torch.equal(a.sign(), b.sign()), name  # the signed step reads only the signs
    assert LearnedQuantizer.of(W, **kw)(p, torch.bfloat16).dtype == torch.bfloat16


def test_a_signed_step_moves_every_value_by_lr_within_its_range() -> None:
    W = torch.randn(4, 32)
    p = RoundingParams.start(W, GROUP)
    learned_fake_quantize(W, p, num_bits=4, symmetric=True, group_size=GROUP).pow(2).sum().backward()
    assert p.V.grad is not None and p.alpha.grad is not None and bool(p.V.grad.ne(0).any())
    sign_step_(p, 0.3)
    assert p.V.grad is None and float(p.V.detach().abs().max()) == pytest.approx(0.3)
    assert float(p.alpha.detach().max()) <= 1.0 and float(p.beta.detach().max()) <= 1.0  # shrinking only


def test_recorded_calls_of_one_shape_stack_into_rows() -> None:
    h = [torch.randn(1, 5, 4) for _ in range(3)]
    pos = torch.arange(5)[None]
    calls = [((x,), {"position_ids": pos, "cache_position": torch.arange(5)}, None) for x in h]
    stacked = Calls.of(calls)
    assert len(stacked.units) == 1 and stacked.rows == 3 and stacked.units[0].mask is None
    args, kwargs = stacked.units[0].select(torch.tensor([0, 2]), torch.device("cpu"))
    torch.testing.assert_close(args[0], torch.cat([h[0], h[2]]))
    assert kwargs["position_ids"].shape == (1, 5)  # the same in every call: kept once
    ragged = Calls.of([*calls, ((torch.randn(1, 7, 4),), {"position_ids": torch.arange(7)[None]}, None)])
    assert [u.rows for u in ragged.units] == [1, 1, 1, 1]  # another length: one unit per call


def test_learned_rounding_beats_round_to_nearest_on_every_layer() -> None:
    fp, ids = tiny_llama(), torch.tensor([row["input_ids"] for row in data(4, 24, seed=7)])
    learned, rtn = tiny_llama(), tiny_llama()
    modifier = AutoRoundModifier(config_groups=SYM, ignore=["lm_head"], iters=30, batch_size=4)
    calibration = [*data(6), *data(2, 20, seed=3)]  # two lengths: the calls do not stack
    oneshot(model=learned, dataset=calibration, recipe=modifier, max_seq_length=32)
    oneshot(
        model=rtn, dataset=calibration, recipe=QuantizationModifier(config_groups=SYM, ignore=["lm_head"])
    )
    ours, theirs = layer_errors(learned, fp, ids), layer_errors(rtn, fp, ids)
    assert all(a < 0.95 * b for a, b in zip(ours, theirs, strict=True)), (ours, theirs)
    assert all(best < first for first, best in modifier.losses.values()), modifier.losses
    with torch.no_grad():
        want = fp(ids).logits
        assert (learned(ids).logits - want).pow(2).mean() < (rtn(ids).logits - want).pow(2).mean()


def test_the_checkpoint_reloads_to_the_returned_model(tmp_path: Path) -> None:
    model, ids = tiny_llama(), torch.tensor([row["input_ids"] for row in data(2, 24, seed=7)])
    recipe = AutoRoundModifier(config_groups=SYM, ignore=["lm_head"], iters=4, batch_size=4)
    oneshot(model=model, dataset=data(4), recipe=recipe, output_dir=str(tmp_path / "out"), max_seq_length=32)
    assert "model.layers.1.mlp.down_proj.weight_packed" in checkpoint_tensors(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(reload(tmp_path / "out", dequantize=True)(ids).logits, model(ids).logits)


def _stopped_run(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path, out: Path, recipe: AutoRoundModifier
) -> None:
    """Run until one subgraph is on disk, then stop as a crash would."""
    monkeypatch.setattr(streaming, "CHECKPOINT_BYTES", 1)  # progress recorded after every subgraph
    done = streaming.StreamingCheckpoint.done

    def stops(self: streaming.StreamingCheckpoint, sg: object) -> None:
        done(self, sg)
        raise KeyboardInterrupt

    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", stops)
    with pytest.raises(KeyboardInterrupt):
        oneshot(model=str(model_dir), dataset=data(4), recipe=recipe, output_dir=str(out), max_seq_length=32)
    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", done)


def test_a_stopped_run_resumes_to_the_same_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_llama().save_pretrained(tmp_path / "model")

    def recipe(reference: str) -> AutoRoundModifier:
        return AutoRoundModifier(
            config_groups=SYM, ignore=["lm_head"], iters=4, batch_size=2, reference=reference
        )

    run = {"dataset": data(4), "max_seq_length": 32, "model": str(tmp_path / "model")}
    oneshot(**run, recipe=recipe("quantized"), output_dir=str(tmp_path / "clean"))
    _stopped_run(monkeypatch, tmp_path / "model", tmp_path / "stopped", recipe("quantized"))
    oneshot(**run, recipe=recipe("quantized"), output_dir=str(tmp_path / "stopped"), resume=True)
    a, b = checkpoint_tensors(tmp_path / "clean"), checkpoint_tensors(tmp_path / "stopped")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the full-precision activations carried between layers are not saved: such a run is refused, not resumed
    _stopped_run(monkeypatch, tmp_path / "model", tmp_path / "fp", recipe("full_precision"))
    with pytest.raises(SeqcalError, match="AutoRoundModifier, which cannot be resumed"):
        oneshot(**run, recipe=recipe("full_precision"), output_dir=str(tmp_path / "fp"), resume=True)


@pytest.mark.parametrize(
    ("recipe", "fragment"),
    [
        ("AutoRoundModifier: {scheme: W4A16, iters: -1}", "iters must be an integer >= 0, got -1"),
        ("AutoRoundModifier: {scheme: W4A16, lr: fast}", "lr must be a positive number or null"),
        (
            "AutoRoundModifier: {scheme: W4A16, lr: -0.01}",
            r"lr must be a positive number or null \(1 / iters\), got -0.01",
        ),
        (
            "AutoRoundModifier: {scheme: W4A16, lr: .nan}",
            r"lr must be a positive number or null \(1 / iters\), got nan",
        ),
        ("AutoRoundModifier: {scheme: W4A16, iters: 2.5}", "iters must be an integer >= 0, got 2.5"),
        ("AutoRoundModifier: {scheme: W4A16, batch_size: 0}", "batch_size must be an integer >= 1"),
        (
            "AutoRoundModifier: {scheme: W4A16, reference: fp}",
            "reference must be one of full_precision, quantized",
        ),
    ],
)
def test_bad_arguments_are_refused_when_the_recipe_is_read(recipe: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as error:
        parse_recipe(recipe)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("scheme", "fragment"),
    [("FP8_BLOCK", "block 8-bit float weights"), ("W4A4_MSE", "weight observer 'mse'")],
)
def test_schemes_it_cannot_learn_are_refused_before_calibrating(scheme: str, fragment: str) -> None:
    """Block fp8 (learned per group, channel or tensor only) and ranges not from min-max are refused."""
    seen = []
    model = tiny_llama(1)
    model.model.layers[0].register_forward_hook(lambda *a: seen.append(1))
    weights = {
        "FP8_BLOCK": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [16, 16]},
        "W4A4_MSE": {**SYM["group_0"]["weights"], "observer": "mse"},
    }[scheme]
    groups = {"g": {"targets": ["Linear"], "weights": weights}}
    recipe = AutoRoundModifier(config_groups=groups, ignore=["lm_head"])
    with pytest.raises(ValueError, match=f"AutoRoundModifier: model.layers.0.self_attn.q_proj .*{fragment}"):
        oneshot(model=model, dataset=data(2), recipe=recipe)
    assert not seen


def test_more_than_one_process_is_refused() -> None:
    assert AutoRoundModifier(scheme="W4A16").shares_statistics() is False


def test_the_same_run_twice_gives_the_same_weights() -> None:
    runs = [tiny_llama(1), tiny_llama(1)]
    for model in runs:
        recipe = AutoRoundModifier(config_groups=SYM, ignore=["lm_head"], iters=3, batch_size=2)
        oneshot(model=model, dataset=data(4), recipe=recipe, max_seq_length=32)
    for (name, a), b in zip(runs[0].named_parameters(), runs[1].parameters(), strict=True):
        assert torch.equal(a, b), name


def test_symmetric_codes_use_the_whole_range_with_signed_scales() -> None:
    W = torch.randn(16, 64)
    W[:, :GROUP] = W[:, :GROUP].abs()  # a group with its maximum the wider side: its scale is negative
    p = RoundingParams.start(W, GROUP)
    q, scale, zp = learned_codes(W, p, num_bits=4, symmetric=True, group_size=GROUP)
    assert zp is None and bool((scale[:, 0] < 0).all()) and bool((scale > 0).any())
    lowest = q.unflatten(-1, (-1, GROUP)).amin(-1)
    assert bool((lowest == -8).all())  # each group's wider side is the lowest code
    torch.testing.assert_close(dequantize(q, scale, None, group_size=GROUP), full_range_rtn(W, 4, GROUP))


ASYM = {"group_0": {**SYM["group_0"], "weights": {**SYM["group_0"]["weights"], "symmetric": False}}}


def test_zero_steps_is_round_to_nearest() -> None:
    for groups in (SYM, ASYM):
        learned, rtn = tiny_llama(1), tiny_llama(1)
        oneshot(
            model=learned,
            dataset=data(2),
            recipe=AutoRoundModifier(config_groups=groups, ignore=["lm_head"], iters=0),
        )
        if groups is ASYM:  # compressed-tensors' round to nearest
            recipe = QuantizationModifier(config_groups=groups, ignore=["lm_head"])
            oneshot(model=rtn, dataset=data(2), recipe=recipe)
        else:  # symmetric: auto-round's, over the whole code range
            with torch.no_grad():
                for name, module in rtn.named_modules():
                    if isinstance(module, torch.nn.Linear) and name != "lm_head":
                        module.weight.copy_(full_range_rtn(module.weight, 4, GROUP))
        for (name, a), b in zip(learned.named_parameters(), rtn.parameters(), strict=True):
            assert torch.equal(a, b), name
