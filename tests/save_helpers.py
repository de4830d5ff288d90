"""Models, schemes and checks shared by the checkpoint tests (test_save*.py).

``rtn`` / ``gptq`` quantize a tiny Llama in place with seqcal.algorithms and return the run state;
``reference_logits`` is the in-memory fake-quantized model's output (with dynamic per-token activation
fake-quant where the scheme asks for it), which a reloaded checkpoint must reproduce.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
from safetensors import safe_open
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, LlamaConfig, LlamaForCausalLM

from seqcal.algorithms import (
    accumulate_hessian,
    fake_quantize,
    fake_quantize_per_token,
    gptq_quantize,
    quantize,
    weight_qparams,
)
from seqcal.modifiers.base import QuantizedWeight, RunState

VOCAB = 128


def tiny_llama(tie: bool = False, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype).eval()
    # .to() rounded the rotary buffers; from_pretrained computes them in float32: rebuild them the same way
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return model


def save_llama(path: Path, layers: int) -> Path:
    """A random Llama saved to ``path``: ``layers`` layers of 128 -> 256, 4 heads over 2 KV heads, 256 tokens."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def weights(num_bits: int = 4, strategy: str = "group", symmetric: bool = True, type: str = "int", **kw):
    group_size = kw.pop("group_size", 16 if strategy == "group" else None)
    return QuantizationArgs(
        num_bits=num_bits, strategy=strategy, symmetric=symmetric, type=type, group_size=group_size, **kw
    )


SCHEMES = {
    "w4a16_g16": QuantizationScheme(targets=["Linear"], weights=weights()),
    "w4a16_asym": QuantizationScheme(targets=["Linear"], weights=weights(symmetric=False)),
    "w8a16_channel": QuantizationScheme(targets=["Linear"], weights=weights(8, "channel")),
    "w3a16_asym_channel": QuantizationScheme(targets=["Linear"], weights=weights(3, "channel", False)),
    "w8a8": preset_name_to_scheme("W8A8", ["Linear"]),
    "fp8_dynamic": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]),
    "fp8_weight_only": QuantizationScheme(targets=["Linear"], weights=weights(8, "tensor", type="float")),
}


def _qargs(scheme: QuantizationScheme) -> dict:
    w = scheme.weights
    return {
        "num_bits": w.num_bits,
        "type": w.type,
        "group_size": w.group_size if w.strategy == "group" else None,
    }


def rtn(model: torch.nn.Module, scheme: QuantizationScheme, names: list[str] | None = None) -> RunState:
    """Round-to-nearest every Linear but lm_head (or ``names``) in place; return the compressed state."""
    state = RunState()
    w = scheme.weights
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head" or (names and name not in names):
            continue
        W = module.weight.data
        kw = _qargs(scheme)
        s, z = weight_qparams(W, symmetric=w.symmetric, strategy=w.strategy, **kw)
        state.results.quantized[name] = QuantizedWeight(
            quantize(W, s, z, **kw), s, None if w.symmetric else z, None, scheme
        )
        module.weight.data = fake_quantize(W, s, z, **kw)
    return state


def gptq(model: torch.nn.Module, scheme: QuantizationScheme, actorder: str | None) -> RunState:
    """GPTQ every Linear but lm_head with Hessians of random inputs; return the compressed state."""
    state = RunState()
    w = scheme.weights
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        X = torch.randn(256, module.in_features) * torch.linspace(
            0.1, 3, module.in_features
        )  # uneven diag(H)
        H, _ = accumulate_hessian(None, X, 0)
        r = gptq_quantize(
            module.weight.data, H, num_bits=w.num_bits, symmetric=w.symmetric, strategy=w.strategy,
            group_size=w.group_size, actorder=actorder, block_size=32,
        )  # fmt: skip
        module.weight.data = r.Q
        zero_point = None if w.symmetric else r.zero_point
        state.results.quantized[name] = QuantizedWeight(r.q, r.scale, zero_point, r.g_idx, scheme, r.loss)
    return state


@contextlib.contextmanager
def dynamic_activations(model: torch.nn.Module, state: RunState) -> Iterator[None]:
    """Per-token input fake-quant on the modules whose scheme quantizes activations (the W8A8 reference)."""
    handles = []
    try:
        for name, qw in state.results.quantized.items():
            acts = qw.scheme.input_activations
            if acts is not None:
                hook = lambda m, args, a=acts: (_dynamic_fake_quant(args[0], a),)
                handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _dynamic_fake_quant(x: torch.Tensor, acts: QuantizationArgs) -> torch.Tensor:
    """seqcal's per-token fake-quant; compressed-tensors' own dynamic fake-quant for groups (FP8_BLOCK, MX)."""
    if str(getattr(acts.strategy, "value", acts.strategy)) != "group":
        return fake_quantize_per_token(x, num_bits=acts.num_bits, type=acts.type)
    scale, zero_point = compute_dynamic_scales_and_zp(x, acts, module=None)
    return ct_fake_quantize(x, scale, zero_point if not acts.symmetric else None, acts)


IDS = torch.randint(4, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


def reference_logits(model: torch.nn.Module, state: RunState) -> torch.Tensor:
    with torch.no_grad(), dynamic_activations(model, state):
        return model(IDS).logits


def reload(out: Path, dequantize: bool = False) -> torch.nn.Module:
    if not dequantize:
        return AutoModelForCausalLM.from_pretrained(out).eval()
    with warnings.catch_warnings():  # "the quantization_config from the model will be used": intended
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        return AutoModelForCausalLM.from_pretrained(
            out, quantization_config=CompressedTensorsConfig(dequantize=True)
        ).eval()


def checkpoint_tensors(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def local(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(name + "."): v for k, v in tensors.items() if k.rpartition(".")[0] == name}


def quantize_case(case: str, model: torch.nn.Module) -> RunState:
    if case == "gptq_w4a16_g16":
        return gptq(model, SCHEMES["w4a16_g16"], actorder="weight")
    return rtn(model, SCHEMES[case])


def assert_logits_equal(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def rtn_lm_head(model: torch.nn.Module) -> QuantizedWeight:
    scheme = SCHEMES["w8a16_channel"]
    W = model.lm_head.weight.data
    s, z = weight_qparams(W, num_bits=8, symmetric=True, strategy="channel")
    model.lm_head.weight.data = fake_quantize(W, s, z, num_bits=8)
    return QuantizedWeight(quantize(W, s, z, num_bits=8), s, None, None, scheme)


def as_bfloat16(model: torch.nn.Module) -> torch.nn.Module:
    """A bfloat16 copy of ``model`` as ``from_pretrained(dtype=torch.bfloat16)`` builds it (rotary in float32)."""
    model = copy.deepcopy(model).to(torch.bfloat16)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return model


def compressed_by_compressed_tensors(
    module: torch.nn.Module, scheme: QuantizationScheme, qparams: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """compressed-tensors' own lifecycle on a copy of a fake-quantized module: initialize its qparams for
    ``scheme``, set them to ``qparams`` (``weight_scale``, ``input_global_scale``, ...), compress it with the
    compressor of its format; returns the module's state as its checkpoint holds it."""
    from compressed_tensors.compressors import compress_module
    from compressed_tensors.quantization.lifecycle import initialize_module_for_quantization
    from compressed_tensors.utils import get_direct_state_dict

    module = copy.deepcopy(module)
    initialize_module_for_quantization(module, scheme.model_copy(deep=True))
    for key, value in qparams.items():
        getattr(module, key).data.copy_(value)
    compress_module(module)
    return {k: v for k, v in get_direct_state_dict(module).items() if v is not None}  # Linear's bias=None


def assert_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], name: str) -> None:
    """The same keys, dtypes and values (bit for bit)."""
    assert sorted(ours) == sorted(theirs), (name, sorted(ours), sorted(theirs))
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), f"{name}.{key}"
