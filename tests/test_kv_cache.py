"""KV-cache quantization (``kv_cache_scheme``): k_scale / v_scale calibrated on the keys and values the
attention caches (after rotary, after q/k norm), saved as compressed-tensors writes them, refused early when
they cannot be.

The expected scales are computed independently: the float model is run with transformers' own DynamicCache,
whose stored keys and values are what the attention kernel reads; their max |x| over the real tokens / 448.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from save_helpers import VOCAB, checkpoint_tensors, reload, tiny_llama
from seqcal import oneshot
from seqcal.checkpoint.writer import save_checkpoint
from seqcal.execution.pipeline import PipelineArgs, run_pipeline
from seqcal.modifiers import GPTQModifier, QuantizationModifier
from seqcal.modifiers.kv_cache import checkpoint_kv_scales, fake_quantized_kv

FP8_MAX = 448.0


def kv(strategy: str = "tensor", **kw) -> dict:
    return {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True, **kw}


def tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    for layer in model.model.layers:  # q/k norms away from 1, so that a key observed before the norm differs
        torch.nn.init.uniform_(layer.self_attn.k_norm.weight, 0.5, 3.0)
    return model


MODELS = {"llama": tiny_llama, "qwen3": tiny_qwen3}


def batches() -> list[dict[str, torch.Tensor]]:
    """Three batches of two samples, left padded: padding tokens must not count."""
    g = torch.Generator().manual_seed(5)
    out = []
    for pad in (0, 3, 6):
        ids = torch.randint(4, VOCAB, (2, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[1, :pad] = 0
        ids[1, :pad] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def reference_absmax(model: torch.nn.Module, data: list[dict], per_head: bool) -> dict[str, torch.Tensor]:
    """max |k| and max |v| per layer (or per layer and kv head) over the real tokens: layer by layer, the model
    run with the layers before it caching fp8 keys and values (scale = max / 448), as seqcal calibrates."""
    out: dict[str, torch.Tensor] = {}
    scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for i in range(model.config.num_hidden_layers):
        name = f"model.layers.{i}.self_attn"
        with torch.no_grad(), fake_quantized_kv(model, scales):
            for batch in data:
                cache = DynamicCache(config=model.config)
                model(**batch, cache=cache, use_cache=True)
                real = batch["attention_mask"].bool()
                for kind, x in (("k", cache.layers[i].keys), ("v", cache.layers[i].values)):
                    tokens = x.transpose(1, 2)[real]  # [tokens, kv_heads, head_dim]
                    m = tokens.abs().amax(dim=(0, 2)) if per_head else tokens.abs().amax().reshape(1)
                    key = f"{name}.{kind}_scale"
                    out[key] = m if key not in out else torch.maximum(out[key], m)
        shape = (-1, 1, 1) if per_head else (1,)
        scales[name] = (
            out[f"{name}.k_scale"].reshape(shape) / FP8_MAX,
            out[f"{name}.v_scale"].reshape(shape) / FP8_MAX,
        )
    return out


def calibrate(model: torch.nn.Module, modifier, **pipe):
    modifier.validate(model)
    return run_pipeline(model, None, [modifier], None, PipelineArgs(**pipe), batches=batches())


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_scales_are_absmax_of_cached_keys_and_values(tmp_path: Path, arch: str, strategy: str) -> None:
    """Only lm_head is quantized (round to nearest, data-free): the kv scheme alone makes calibration run; the
    scales equal max |x| / 448 of the model whose earlier layers already cache fp8 keys and values."""
    model = MODELS[arch]()
    expected = reference_absmax(model, batches(), per_head=strategy == "attn_head")
    modifier = QuantizationModifier(
        targets=["lm_head"], scheme="FP8_DYNAMIC", kv_cache_scheme=kv(strategy, observer="static_minmax")
    )
    state = calibrate(model, modifier)
    out = save_checkpoint(model, state, tmp_path / "out")
    tensors = checkpoint_tensors(out)
    for key, absmax in expected.items():
        got = tensors[key]
        assert got.dtype == torch.float32
        assert tuple(got.shape) == ((2, 1, 1) if strategy == "attn_head" else (1,))
        torch.testing.assert_close(got.reshape(-1), absmax / FP8_MAX, rtol=1e-6, atol=0)
    assert not [k for k in tensors if "zero_point" in k and "self_attn" in k]
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    assert block["kv_cache_scheme"]["strategy"] == strategy
    assert block["kv_cache_scheme"]["num_bits"] == 8 and block["kv_cache_scheme"]["type"] == "float"


INT8_WEIGHTS = {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel",
                                                          "symmetric": True}}}  # fmt: skip


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
@pytest.mark.parametrize("shards", [1, 3])
def test_one_pass_scales_are_absmax_of_the_keys_and_values_inference_computes(
    arch: str, strategy: str, shards: int, caplog
) -> None:
    """With the attention's Linears quantized too, the one-pass cut observes the keys and values through its
    stand-in cache after k_proj / v_proj are quantized and with every earlier layer quantized (its KV cache
    fp8): the scales are max |x| / 448 of the calibrated model itself, layer by layer, bit for bit."""
    model = MODELS[arch]()
    modifier = QuantizationModifier(config_groups=INT8_WEIGHTS, ignore=["lm_head"],
                                    kv_cache_scheme=kv(strategy, observer="static_minmax"))  # fmt: skip
    with caplog.at_level(logging.INFO, logger="seqcal"):
        calibrate(model, modifier, num_shards=shards)
    assert any("one pass: cut before each group" in r.getMessage() for r in caplog.records)
    expected = reference_absmax(model, batches(), per_head=strategy == "attn_head")  # the quantized weights
    for key, absmax in expected.items():
        name, _, buffer = key.rpartition(".")
        got = getattr(model.get_submodule(name), buffer)
        assert torch.equal(got.reshape(-1), absmax / FP8_MAX), key


def test_one_pass_kv_cache_of_a_model_read_from_disk_equals_the_model_in_memory(tmp_path: Path) -> None:
    """Offloaded weights (read per subgraph) and the streaming checkpoint: the attention's scales are written
    with the subgraph that runs its cache update, equal to those of the model held in RAM."""
    model = tiny_llama()
    model.save_pretrained(tmp_path / "model")
    data = [
        {"input_ids": ids[m.bool()].tolist()} for b in batches() for ids, m in zip(*b.values(), strict=True)
    ]
    recipe = {"config_groups": INT8_WEIGHTS, "ignore": ["lm_head"], "kv_cache_scheme": kv()}
    for source, out in ((str(tmp_path / "model"), "disk"), (model, "ram")):
        oneshot(model=source, dataset=data, recipe=QuantizationModifier(**recipe), output_dir=str(tmp_path / out),
                max_seq_length=12, num_calibration_samples=len(data), batch_size=1, dtype="float32")  # fmt: skip
    disk, ram = checkpoint_tensors(tmp_path / "disk"), checkpoint_tensors(tmp_path / "ram")
    assert disk.keys() == ram.keys() and "model.layers.1.self_attn.v_scale" in disk
    assert not [k for k in disk if not torch.equal(disk[k], ram[k])]


def test_qwen3_scales_read_keys_after_the_k_norm() -> None:
    """The k norm scales keys by up to 3: a scale from k_proj's output would be far off."""
    model = tiny_qwen3()
    expected = reference_absmax(model, batches(), per_head=False)
    raw = {}
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(
            lambda m, a, out, i=i: raw.__setitem__(i, max(raw.get(i, 0.0), out.abs().max().item()))
        )
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        for batch in batches():
            model(**batch)
    for h in hooks:
        h.remove()
    modifier = QuantizationModifier(
        targets=["lm_head"], scheme="FP8_DYNAMIC", kv_cache_scheme=kv(observer="static_minmax")
    )
    calibrate(model, modifier)
    for i, layer in enumerate(model.model.layers):
        got = layer.self_attn.k_scale * FP8_MAX
        torch.testing.assert_close(got, expected[f"model.layers.{i}.self_attn.k_scale"], rtol=1e-6, atol=0)
        assert abs(got.item() - raw[i]) > 0.05 * raw[i]


def test_minmax_observer_is_a_moving_average_over_batches() -> None:
    """The default observer (minmax) averages each batch's min and max with constant 0.01, as
    llm-compressor's; the scale is then the larger magnitude of the two / 448. (One virtual shard: across
    shards the per-shard ranges are averaged, as for static input observers; see the next test.)"""
    model = tiny_llama()
    lo = hi = None
    with torch.no_grad():
        for batch in batches():
            cache = DynamicCache(config=model.config)
            model(**batch, cache=cache, use_cache=True)
            values = cache.layers[0].values.transpose(1, 2)[batch["attention_mask"].bool()]
            b_lo, b_hi = values.min(), values.max()
            lo = b_lo if lo is None else lo * 0.99 + b_lo * 0.01
            hi = b_hi if hi is None else hi * 0.99 + b_hi * 0.01
    modifier = QuantizationModifier(targets=["lm_head"], scheme="FP8_DYNAMIC", kv_cache_scheme=kv())
    calibrate(model, modifier, num_shards=1)
    expected = torch.maximum(lo.abs(), hi.abs()).reshape(1) / FP8_MAX
    torch.testing.assert_close(model.model.layers[0].self_attn.v_scale, expected, rtol=1e-6, atol=0)


def test_minmax_observer_averages_the_ranges_of_the_virtual_shards() -> None:
    """With a shard per batch, the key / value range is the mean of the shards' ranges (the reduction that
    makes the scales independent of the number of processes)."""
    model = tiny_llama()
    los, his = [], []
    with torch.no_grad():
        for batch in batches():
            cache = DynamicCache(config=model.config)
            model(**batch, cache=cache, use_cache=True)
            values = cache.layers[0].values.transpose(1, 2)[batch["attention_mask"].bool()]
            los.append(values.min())
            his.append(values.max())
    modifier = QuantizationModifier(targets=["lm_head"], scheme="FP8_DYNAMIC", kv_cache_scheme=kv())
    calibrate(model, modifier, num_shards=len(batches()))
    lo, hi = sum(los) / len(los), sum(his) / len(his)
    expected = torch.maximum(lo.abs(), hi.abs()).reshape(1) / FP8_MAX
    torch.testing.assert_close(model.model.layers[0].self_attn.v_scale, expected, rtol=1e-6, atol=0)


def test_fp8_static_with_kv_cache_reloads_in_transformers(tmp_path: Path, caplog) -> None:
    """FP8 weights and static activations + FP8 KV cache through oneshot (streaming writer) in bfloat16:
    scales in the attention's dtype, the checkpoint loads in transformers and runs."""
    model = tiny_llama(dtype=torch.bfloat16)
    data = [
        {"input_ids": ids[m.bool()].tolist()} for b in batches() for ids, m in zip(*b.values(), strict=True)
    ]
    recipe = GPTQModifier(scheme="FP8", ignore=["lm_head"], kv_cache_scheme=kv("attn_head"))
    with caplog.at_level(logging.INFO, logger="seqcal"):
        oneshot(model=model, dataset=data, recipe=recipe, output_dir=str(tmp_path / "out"), max_seq_length=12,
                num_calibration_samples=len(data), batch_size=1)  # fmt: skip
    assert any("one pass: cut before each group" in r.getMessage() for r in caplog.records)
    tensors = checkpoint_tensors(tmp_path / "out")
    for i in range(2):
        for kind in ("k", "v"):
            scale = tensors[f"model.layers.{i}.self_attn.{kind}_scale"]
            assert scale.dtype == torch.bfloat16 and tuple(scale.shape) == (2, 1, 1)
            assert bool((scale > 0).all())
    loaded = reload(tmp_path / "out")
    with torch.no_grad():
        logits = loaded(batches()[0]["input_ids"]).logits
    assert torch.isfinite(logits.float()).all()


# --- refused before calibration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, "num_bits 4"),
        (kv(dynamic=True), "dynamic True"),
        (kv(strategy="channel"), "strategy channel"),
        (kv(observer="nope"), "observer 'nope'"),
    ],
)
def test_unsupported_kv_scheme_lists_what_is_supported(spec: dict, words: str) -> None:
    with pytest.raises(ValueError) as err:
        QuantizationModifier(scheme="FP8_DYNAMIC", kv_cache_scheme=spec)
    assert words in str(err.value)
    if "observer" not in words:
        assert "supported: fp8 with static scales" in str(err.value) and "attn_head" in str(err.value)


class OpaqueAttention(torch.nn.Module):
    """An attention whose forward takes no cache argument: its cached keys and values are out of reach."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.k_proj, self.v_proj, self.inner = inner.k_proj, inner.v_proj, inner

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        return self.inner(hidden_states, **kwargs)


def test_attention_without_a_cache_argument_is_refused_before_calibration() -> None:
    model = tiny_llama()
    model.model.layers[0].self_attn = OpaqueAttention(model.model.layers[0].self_attn)
    modifier = QuantizationModifier(scheme="FP8_DYNAMIC", kv_cache_scheme=kv())
    with pytest.raises(ValueError) as err:
        modifier.validate(model)
    message = str(err.value)
    assert "model.layers.0.self_attn (OpaqueAttention)" in message
    assert "takes none of cache, past_key_values" in message and "remove kv_cache_scheme" in message


def test_attention_traced_into_is_named_with_the_fix() -> None:
    """trace_into opens the attention: its forward no longer runs as a module, so nothing is observed."""
    model = tiny_llama()
    modifier = QuantizationModifier(targets=["lm_head"], scheme="FP8_DYNAMIC", kv_cache_scheme=kv())
    with pytest.raises(RuntimeError) as err:
        calibrate(model, modifier, trace_into="all")
    assert "model.layers.0.self_attn were never seen" in str(err.value) and "trace_into" in str(err.value)


def test_fake_quantized_kv_stores_fp8_keys_and_values_with_the_checkpoint_scales(tmp_path: Path) -> None:
    """For evaluation: the cache holds x / scale cast to float8_e4m3fn times scale, as vLLM's fp8 KV cache."""
    model = tiny_qwen3()
    modifier = QuantizationModifier(
        targets=["lm_head"], scheme="FP8_DYNAMIC", kv_cache_scheme=kv("attn_head")
    )
    state = calibrate(model, modifier)
    out = save_checkpoint(model, state, tmp_path / "out")
    scales = checkpoint_kv_scales(checkpoint_tensors(out))
    assert sorted(scales) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    batch = batches()[1]
    with torch.no_grad():
        float_cache = DynamicCache(config=model.config)
        model(**batch, cache=float_cache, use_cache=True)
        quant_cache = DynamicCache(config=model.config)
        with fake_quantized_kv(model, scales):
            model(**batch, cache=quant_cache, use_cache=True)
    k_scale, v_scale = scales["model.layers.0.self_attn"]
    for got, x, s in ((quant_cache.layers[0].keys, float_cache.layers[0].keys, k_scale),
                      (quant_cache.layers[0].values, float_cache.layers[0].values, v_scale)):  # fmt: skip
        want = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert not torch.equal(got, x)
    assert not model.model.layers[0].self_attn._forward_pre_hooks  # removed on exit


def test_scales_of_a_model_read_from_disk_per_subgraph(tmp_path: Path) -> None:
    """A model given as a directory is calibrated with its weights offloaded (read per subgraph); the scales
    are the same as for the model held in RAM."""
    model = tiny_llama()
    model.save_pretrained(tmp_path / "model")
    expected = reference_absmax(model, batches(), per_head=False)
    data = [
        {"input_ids": ids[m.bool()].tolist()} for b in batches() for ids, m in zip(*b.values(), strict=True)
    ]
    recipe = QuantizationModifier(
        targets=["lm_head"], scheme="FP8_DYNAMIC", kv_cache_scheme=kv(observer="static_minmax")
    )
    oneshot(model=str(tmp_path / "model"), dataset=data, recipe=recipe, output_dir=str(tmp_path / "out"),
            max_seq_length=12, num_calibration_samples=len(data), batch_size=1, dtype="float32")  # fmt: skip
    tensors = checkpoint_tensors(tmp_path / "out")
    for key, absmax in expected.items():
        torch.testing.assert_close(tensors[key], absmax / FP8_MAX, rtol=1e-6, atol=0)
