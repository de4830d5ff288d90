"""AWQModifier: the fold keeps the float model, the search finds the best grid scale, AWQ beats RTN, the
checkpoint reloads to the same model, and bad mappings fail before calibrating."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from seqcal.algorithms import fake_quantize, weight_qparams
from seqcal.algorithms.awq import grid_points, search_scales
from seqcal.entrypoint import oneshot
from seqcal.mappings import fold_scales
from seqcal.modifiers import AWQModifier, QuantizationModifier, awq_search
from seqcal.modifiers._awq_mappings import resolve
from seqcal.recipe.parse import parse_recipe

VOCAB = 128
GROUP = 16
ASYM = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                       "strategy": "group", "group_size": GROUP}}}  # fmt: skip


def tiny_llama(layers: int = 2, outliers: bool = True, kv_heads: int = 2) -> LlamaForCausalLM:
    """Random weights; a few norm channels 20x larger, so activations have outlier channels as trained LLMs do."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    if outliers:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.input_layernorm.weight[[3, 17, 40]] = 20.0
                layer.post_attention_layernorm.weight[[5, 33]] = 15.0
                layer.mlp.up_proj.weight[[7, 90]] *= 10.0  # outliers into down_proj too
    return model


def token_data(n: int = 6, length: int = 32) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [
        {"input_ids": (torch.randint(-3, 4, (length,), generator=g).cumsum(0) % VOCAB).tolist()}
        for _ in range(n)
    ]


IDS = torch.tensor([row["input_ids"] for row in token_data(3, 24)])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_fold_keeps_the_float_model_output() -> None:
    model, reference = tiny_llama(), logits(tiny_llama())
    mappings, skipped = resolve(model, None)
    # GQA: v_proj (32 outputs) cannot be folded into o_proj (64 inputs), skipped as llm-compressor does
    assert [m.parent for m in mappings[:3]] == ["model.layers.0.self_attn", "model.layers.1.self_attn",
                                                 "model.layers.0.mlp"]  # fmt: skip
    assert len(mappings) == 6 and len(skipped) == 2 and "v_proj" in skipped[0]
    g = torch.Generator().manual_seed(0)
    for m in mappings:
        fold_scales(model, m.mapping(), torch.rand(m.width, generator=g) * 4 + 0.25)
    torch.testing.assert_close(logits(model), reference, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(
        model.model.layers[0].input_layernorm.weight, tiny_llama().model.layers[0].input_layernorm.weight
    )


def test_a_norm_that_does_not_scale_by_its_weight_is_refused() -> None:
    class OnePlusNorm(torch.nn.Module):  # Gemma's RMSNorm computes x * (1 + weight)
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (1 + self.weight)

    model = tiny_llama(1)
    model.model.layers[0].input_layernorm = OnePlusNorm()
    with pytest.raises(ValueError, match="offset norm: OnePlusNorm's output does not scale with its weight"):
        resolve(model, None)  # refused when resolved, before any scale is searched or folded
    assert torch.equal(model.model.layers[0].input_layernorm.weight, torch.zeros(64))


def _brute_force(X: torch.Tensor, W: torch.Tensor, n_grid: int) -> tuple[float, float, torch.Tensor]:
    """Every grid scale of up_proj -> down_proj tried by hand: (best ratio, its loss, its scale)."""
    x_mean = X.abs().mean(0)
    A = W.abs().reshape(-1, GROUP)
    w_mean = (A / (A.amax(1, keepdim=True) + 1e-6)).reshape(W.shape).mean(0)
    best = (None, float("inf"), None)
    candidates = [(0.0, False)] + [(i / (n_grid - 2), True) for i in range(n_grid - 1)]
    for ratio, duo in candidates:
        s = (
            (x_mean**ratio / (w_mean ** (1 - ratio) + 1e-4)).clamp(min=1e-4)
            if duo
            else (x_mean**ratio).clamp(min=1e-4)
        )
        s = s / (s.max() * s.min()).sqrt()
        scale, zp = weight_qparams(W * s, num_bits=4, symmetric=False, strategy="group", group_size=GROUP)
        Wq = fake_quantize(W * s, scale, zp, num_bits=4, group_size=GROUP) / s
        loss = (X @ Wq.T - X @ W.T).pow(2).mean().item()
        if loss < best[1]:
            best = (ratio, loss, s)
    return best


def test_search_picks_the_grid_scale_with_the_lowest_loss() -> None:
    model, original = tiny_llama(1), tiny_llama(1)
    captured: list[torch.Tensor] = []
    down = original.model.layers[0].mlp.down_proj
    handle = down.register_forward_pre_hook(lambda _m, args: captured.append(args[0].reshape(-1, 128)))
    data = token_data()
    with torch.no_grad():
        original(torch.tensor([row["input_ids"] for row in data]))
    handle.remove()
    ratio, loss, s = _brute_force(torch.cat(captured), down.weight.detach(), n_grid=8)
    oneshot(model=model, dataset=data, recipe=AWQModifier(config_groups=ASYM, ignore=["lm_head"], n_grid=8),
            max_seq_length=32)  # fmt: skip
    # the layer's first subgraph calibrates on float inputs, so down_proj saw exactly the captured inputs
    report = model.model.layers[0].mlp.down_proj
    errors = _errors(model)["model.layers.0.mlp.down_proj"]
    assert errors["awq_ratio"] == pytest.approx(ratio) and errors["awq_loss"] == pytest.approx(loss, rel=1e-4)
    W = down.weight.detach() * s  # the folded weight, then round-to-nearest
    scale, zp = weight_qparams(W, num_bits=4, symmetric=False, strategy="group", group_size=GROUP)
    torch.testing.assert_close(report.weight.data, fake_quantize(W, scale, zp, num_bits=4, group_size=GROUP))


def test_v_proj_to_o_proj_derived_from_the_graph_picks_the_brute_force_scale() -> None:
    # Without grouped kv heads the graph gives v_proj -> o_proj through attention and its KV-cache write (as
    # llm-compressor's default mappings); o_proj reads the float attention output in the first layer.
    model, original = tiny_llama(1, kv_heads=4), tiny_llama(1, kv_heads=4)
    captured: list[torch.Tensor] = []
    o_proj = original.model.layers[0].self_attn.o_proj
    handle = o_proj.register_forward_pre_hook(lambda _m, args: captured.append(args[0].reshape(-1, 64)))
    data = token_data()
    with torch.no_grad():
        original(torch.tensor([row["input_ids"] for row in data]))
    handle.remove()
    ratio, loss, s = _brute_force(torch.cat(captured), o_proj.weight.detach(), n_grid=8)
    oneshot(model=model, dataset=data, recipe=AWQModifier(config_groups=ASYM, ignore=["lm_head"], n_grid=8),
            max_seq_length=32)  # fmt: skip
    errors = _errors(model)["model.layers.0.self_attn.o_proj"]
    assert errors["awq_ratio"] == pytest.approx(ratio) and errors["awq_loss"] == pytest.approx(loss, rel=1e-4)
    W = o_proj.weight.detach() * s  # the folded weight, then round-to-nearest
    scale, zp = weight_qparams(W, num_bits=4, symmetric=False, strategy="group", group_size=GROUP)
    quantized = model.model.layers[0].self_attn.o_proj.weight.data
    torch.testing.assert_close(quantized, fake_quantize(W, scale, zp, num_bits=4, group_size=GROUP))


def _errors(model: torch.nn.Module) -> dict:
    return model._seqcal_state.results.module_errors  # set by the fixture below


@pytest.fixture(autouse=True)
def _keep_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the run state on the model so tests can read the per-module AWQ numbers."""
    import seqcal.execution.pipeline as pipeline

    run = pipeline._run

    def keeping(model, *args, **kwargs):
        state = run(model, *args, **kwargs)
        model._seqcal_state = state
        return state

    monkeypatch.setattr(pipeline, "_run", keeping)


def test_grid_search_is_exhaustive_and_keeps_the_first_minimum() -> None:
    x_mean, w_mean = torch.tensor([1.0, 8.0, 0.5]), torch.tensor([0.2, 0.9, 0.4])
    seen: list[torch.Tensor] = []
    result = search_scales(lambda s: seen.append(s) or float((s[1] - 1.3) ** 2), x_mean, w_mean, 10, "both")
    assert len(seen) == len(grid_points(10, "both")) == 10
    losses = [float((s[1] - 1.3) ** 2) for s in seen]
    assert result.loss == min(losses) and torch.equal(result.scales, seen[losses.index(min(losses))])
    assert torch.equal(seen[0], torch.ones(3))  # ratio 0 without weights: the identity scale (plain RTN)


def test_awq_loss_is_at_most_rtn_loss_per_mapping_and_beats_rtn_on_the_output() -> None:
    awq, rtn, reference = tiny_llama(), tiny_llama(), logits(tiny_llama())
    data = token_data()
    oneshot(model=awq, dataset=data, recipe=AWQModifier(config_groups=ASYM, ignore=["lm_head"], n_grid=10),
            max_seq_length=32)  # fmt: skip
    oneshot(model=rtn, dataset=data, recipe=QuantizationModifier(config_groups=ASYM, ignore=["lm_head"]),
            max_seq_length=32)  # fmt: skip
    errors = _errors(awq)
    skips = [line for line in awq._seqcal_state.results.log if "skipped as llm-compressor does" in line]
    assert len(skips) == 1 and skips[0].startswith("AWQ: 2 mapping(s)"), (
        awq._seqcal_state.results.log
    )  # one line
    balanced = [n for n, e in errors.items() if "awq_loss" in e]
    assert len(balanced) == 2 * (3 + 2 + 1)  # q/k/v, gate/up, down per layer (v -> o skipped under GQA)
    for name in balanced:  # the search includes the identity scale, whose loss is plain RTN's
        assert errors[name]["awq_loss"] <= errors[name]["awq_initial_loss"], name
    improved = [n for n in balanced if errors[n]["awq_loss"] < 0.9 * errors[n]["awq_initial_loss"]]
    assert len(improved) >= len(balanced) // 2, improved  # outlier channels: the scales pay off
    awq_error = (logits(awq) - reference).pow(2).mean()
    rtn_error = (logits(rtn) - reference).pow(2).mean()
    assert awq_error < rtn_error


def test_llm_compressor_0_14_recipe_saves_a_checkpoint_transformers_reloads(tmp_path: Path) -> None:
    recipe = f"""
quant_stage:
  quant_modifiers:
    AWQModifier: {{duo_scaling: both, n_grid: 6}}
    QuantizationModifier:
      ignore: [lm_head]
      config_groups: {ASYM}
"""
    parsed = parse_recipe(recipe).modifiers
    assert len(parsed) == 1 and isinstance(parsed[0], AWQModifier) and parsed[0].duo_scaling == "both"
    model, out = tiny_llama(), tmp_path / "out"
    float_norm = model.model.layers[1].input_layernorm.weight.detach().clone()
    oneshot(model=model, dataset=token_data(), recipe=recipe, output_dir=str(out), max_seq_length=32)
    assert not torch.equal(model.model.layers[1].input_layernorm.weight, float_norm)  # scales folded in
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=1e-5)
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    assert block["config_groups"]["group_0"]["weights"]["symmetric"] is False
    assert "AWQModifier" in (out / "recipe.yaml").read_text()


def test_llm_compressor_awq_recipe_with_explicit_mappings_parses() -> None:
    # tests/e2e/vLLM/recipes/non_uniform/recipe_gptq_awq.yaml (llm-compressor, Apache-2.0)
    recipe = parse_recipe("""
quant_stage:
  quant_modifiers:
    AWQModifier:
      ignore: ["lm_head"]
      duo_scaling: true
      scheme: "W4A16"
      targets:
        - "re:.*self_attn\\\\.(k|q|o|v)_proj$"
      mappings:
        - smooth_layer: "re:.*input_layernorm$"
          balance_layers: ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]
    GPTQModifier:
      ignore: ["lm_head"]
      scheme: "W8A8"
      targets:
        - "re:.*mlp\\\\.(down|gate|up)_proj$"
""")
    awq = recipe.modifiers[0]
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1)  # W4A16: groups of 128  # fmt: skip
    recipe.validate(LlamaForCausalLM(config))
    assert [m.smooth for m in awq._mappings] == [
        "model.layers.0.input_layernorm",
        "model.layers.1.input_layernorm",
    ]
    assert sorted(awq.modules)[:2] == ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.o_proj"]


BAD = {
    "smooth pattern matches nothing": (
        {"mappings": [{"smooth_layer": "re:.*no_such_norm$", "balance_layers": ["re:.*q_proj$"]}]},
        "mappings[0].smooth_layer 're:.*no_such_norm$' matches no module",
    ),
    "balance pattern matches nothing": (
        {"mappings": [{"smooth_layer": "re:.*input_layernorm$", "balance_layers": ["re:.*qq_proj$"]}]},
        "balance_layers pattern 're:.*qq_proj$' matches no module",
    ),
    "balance layers of different input widths": (
        {
            "mappings": [
                {
                    "smooth_layer": "re:.*post_attention_layernorm$",
                    "balance_layers": ["re:.*gate_proj$", "re:.*down_proj$"],
                }
            ]
        },  # fmt: skip
        "balances layers of different input widths",
    ),
    "no scheme and no QuantizationModifier after it": ({"config_groups": None}, "no quantization scheme"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_mappings_fail_before_calibrating_in_one_sentence(case: str) -> None:
    kwargs, match = BAD[case]
    called = []
    model = tiny_llama(1)
    model.register_forward_pre_hook(lambda *_: called.append(1))
    with pytest.raises(
        ValueError, match=match.replace("[", r"\[").replace("$", r"\$").replace("*", r"\*")
    ) as info:
        oneshot(model=model, dataset=token_data(2), max_seq_length=32,
                recipe=AWQModifier(**{"config_groups": ASYM, "ignore": ["lm_head"], **kwargs}))  # fmt: skip
    message = str(info.value)
    assert "\n" not in message and message.count(". ") == 0 and message.startswith("AWQModifier")
    assert not called  # refused before any forward pass


def test_cli_names_the_bad_mapping(tmp_path: Path) -> None:
    import subprocess

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"AWQModifier:\n  config_groups: {ASYM}\n  mappings:\n    - smooth_layer: 're:.*nope$'\n"
                      "      balance_layers: ['re:.*q_proj$']\n")  # fmt: skip
    model = tiny_llama(1, outliers=False)
    model.save_pretrained(tmp_path / "model")
    proc = subprocess.run([sys.executable, "-m", "seqcal.cli", "oneshot", "--model", str(tmp_path / "model"),
                           "--recipe", str(recipe), "--output-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "seqcal: error:" in proc.stderr and "matches no module" in proc.stderr, proc.stderr


def test_the_next_layer_calibrates_on_the_awq_quantized_layer_output() -> None:
    model, data = tiny_llama(), token_data(1)
    seen: list[torch.Tensor] = []
    handle = model.model.layers[1].register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).clone()),
        with_kwargs=True,
    )
    oneshot(model=model, dataset=data, recipe=AWQModifier(config_groups=ASYM, ignore=["lm_head"], n_grid=4),
            max_seq_length=32)  # fmt: skip
    handle.remove()
    ids = torch.tensor([data[0]["input_ids"]])
    with torch.no_grad():
        quantized = model(ids, output_hidden_states=True).hidden_states[1]
        floating = tiny_llama()(ids, output_hidden_states=True).hidden_states[1]
    torch.testing.assert_close(seen[-1], quantized, rtol=1e-5, atol=1e-5)  # layer 1 ran on layer 0 quantized
    assert not torch.allclose(seen[-1], floating, atol=1e-3)


def test_a_model_read_from_disk_gives_the_checkpoint_of_the_model_in_memory(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(tmp_path / "model")
    recipe = AWQModifier(config_groups=ASYM, ignore=["lm_head"], n_grid=4)
    in_memory = tiny_llama()
    oneshot(
        model=in_memory,
        dataset=token_data(2),
        recipe=recipe,
        output_dir=str(tmp_path / "a"),
        max_seq_length=32,
    )
    oneshot(model=str(tmp_path / "model"), dataset=token_data(2), recipe=recipe, output_dir=str(tmp_path / "b"),
            max_seq_length=32)  # fmt: skip  # weights read per subgraph: the folded norms must reach the file
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
    torch.testing.assert_close(logits(b), logits(a), rtol=0, atol=1e-6)
    torch.testing.assert_close(logits(a), logits(in_memory), rtol=0, atol=1e-5)


def test_experts_inside_opaque_code_keep_llm_compressors_mappings() -> None:
    """The graph cannot show a loop over experts: AWQ then uses llm-compressor's mappings, experts included."""
    from zoo import ARCHS

    model = ARCHS["qwen3_moe"].build()
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(3, 250, (16,), generator=gen).tolist()} for _ in range(4)]
    awq = parse_recipe(
        "AWQModifier: {config_groups: {group_0: {targets: [Linear], weights: {num_bits: 4, type: int, symmetric: "
        "false, strategy: group, group_size: 16}}}, ignore: [lm_head, 're:.*mlp.gate$'], n_grid: 3}"
    ).modifiers[0]
    oneshot(model=model, dataset=data, recipe=[awq])
    smoothed = {m.smooth for m in awq._mappings}
    assert "model.layers.0.mlp.experts.0.up_proj" in smoothed  # up_proj -> down_proj of an expert
    assert "model.layers.0.post_attention_layernorm" in smoothed


def test_a_linear_span_is_scored_from_its_gram_matrix_as_if_it_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """o_proj / down_proj alone as the span: the losses from X^T X equal those of running it, so do the scales."""
    from zoo import ARCHS

    recipe = ("AWQModifier: {config_groups: {group_0: {targets: [Linear], weights: {num_bits: 4, type: int, "
              "symmetric: false, strategy: group, group_size: 16}}}, ignore: [lm_head], n_grid: 6}")  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    # more tokens (288) than down_proj's inputs (128): the search takes the Gram matrix
    data = [{"input_ids": torch.randint(3, 250, (48,), generator=gen).tolist()} for _ in range(6)]
    runs = {}
    for gram in (True, False):
        if not gram:
            monkeypatch.setattr(awq_search, "_gram", lambda *args: None)
        model, awq = ARCHS["llama"].build(), parse_recipe(recipe).modifiers[0]
        oneshot(model=model, dataset=data, recipe=[awq], output_dir=str(tmp_path / str(gram)))
        report = json.loads((tmp_path / str(gram) / "quantization_report.json").read_text())
        runs[gram] = (model, awq, report["modules"])
    (gram_model, gram_awq, gram_errors), (ran_model, _, ran_errors) = runs[True], runs[False]
    linear = [m.parent for m in gram_awq._mappings if [m.parent] == list(m.balance)]
    assert "model.layers.1.mlp.down_proj" in linear
    for name in linear:  # the search's best loss, computed both ways
        got, want = gram_errors[name]["awq_loss"], ran_errors[name]["awq_loss"]
        assert got == pytest.approx(want, rel=1e-4) and want > 0, name
    # the same grid point wins: the same folded scales, the same quantized model
    for (name, a), (_, b) in zip(gram_model.named_parameters(), ran_model.named_parameters()):
        assert torch.equal(a, b), name


def test_screening_runs_fewer_spans_and_keeps_the_exhaustive_winner_when_shortlisted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Screening (one virtual shard of 8 batches) scores the grid on every 2nd batch and the identity plus the
    2 best on the rest: fewer span runs; a mapping whose exhaustive winner made the shortlist gets the same
    ratio and the same loss bit for bit, any other one a loss no lower than the exhaustive one (the minimum over
    every point) and never above plain round-to-nearest's."""
    from seqcal.modifiers.spans import SpanCache

    runs = {"count": 0}
    real_run = SpanCache.run

    def counting(self, module, device, index):
        runs["count"] += 1
        return real_run(self, module, device, index)

    monkeypatch.setattr(SpanCache, "run", counting)
    results, counts = {}, {}
    for keep in (None, 2):
        model = tiny_llama()
        runs["count"] = 0
        recipe = AWQModifier(
            config_groups=ASYM, ignore=["lm_head"], n_grid=10, screen_every=2, screen_keep=keep
        )
        oneshot(model=model, dataset=token_data(8), recipe=recipe, max_seq_length=32, num_shards=1)
        results[keep], counts[keep] = _errors(model), runs["count"]
    exhaustive, screened = results[None], results[2]
    spans = [n for n, e in screened.items() if e.get("awq_screened")]
    assert spans and all(screened[n]["awq_screened"] == 10 - 3 for n in spans)  # 7 points left out per span
    assert all(exhaustive[n]["awq_screened"] == 0 for n in exhaustive if "awq_loss" in exhaustive[n])
    # per span search: 10 points x 4 screening batches + 3 kept points x 4 other batches, against 10 x 8
    searches = counts[None] // (10 * 8)
    assert counts[None] == searches * 10 * 8 and counts[2] == searches * (10 * 4 + 3 * 4)
    same = 0
    for name in spans:
        e, s = exhaustive[name], screened[name]
        assert s["awq_initial_loss"] == e["awq_initial_loss"] and s["awq_loss"] <= s["awq_initial_loss"]
        if s["awq_ratio"] == e["awq_ratio"]:
            same += 1
            assert s["awq_loss"] == e["awq_loss"], name  # the same sums in the same order
        else:
            assert s["awq_loss"] > e["awq_loss"], name
    assert same >= len(spans) // 2, (same, len(spans))


def test_screening_arguments_are_checked() -> None:
    for bad in ({"screen_every": 0}, {"screen_keep": 0}, {"screen_keep": True}, {"screen_every": 1.5}):
        with pytest.raises(ValueError, match="screen_"):
            AWQModifier(config_groups=ASYM, **bad)


def test_linear_error_from_the_gram_matrix_upper_blocks_equals_the_dense_error() -> None:
    """Two batches of 300 features (three column blocks on the CPU, only the upper ones summed): the same
    squared output error as running the Linear, in float64; a Gram matrix missing a block row would not be."""
    from seqcal.algorithms.awq import add_gram, linear_error

    g = torch.Generator().manual_seed(0)
    X1, X2, E = (
        torch.randn(70, 300, generator=g),
        torch.randn(50, 300, generator=g),
        torch.randn(5, 300, generator=g),
    )
    gram = add_gram(add_gram(None, X1), X2)
    X = torch.cat([X1, X2]).double()
    dense = float((X @ E.double().T).pow(2).sum())
    assert linear_error(E, gram) == pytest.approx(dense, rel=1e-5)
    assert not torch.equal(gram, gram.T)  # below the diagonal blocks nothing was summed
    broken = gram.clone()
    broken[128:256] = 0
    assert linear_error(E, broken) != pytest.approx(dense, rel=1e-2)
