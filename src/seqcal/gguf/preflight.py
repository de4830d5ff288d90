"""What ``output_format="gguf"`` refuses before any weight is calibrated, one sentence each.

A GGUF scheme without GGUF output (compressed-tensors has no k-quants), GGUF output of modules quantized by
another scheme, a family, tensor or tokenizer the writer cannot describe to llama.cpp, a quantized ``lm_head``
tied to the token embedding (llama.cpp stores one tensor for both), and an output directory that holds
a safetensors checkpoint (a ``model.gguf`` beside it would leave two models in one directory). A resume is
refused by ``OutputArgs``: the file is written in one run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from seqcal.gguf.families import family_of, tensor_namer, tied_output
from seqcal.gguf.scheme import GGUFScheme
from seqcal.gguf.vocab import check_tokenizer


def check_gguf_output(model: torch.nn.Module, modifiers: Any, output: Any, tokenizer: Any) -> None:
    """Refuse what the chosen output format cannot hold (``output``: the run's ``OutputArgs``).

    Raises:
        ValueError: one sentence naming what, where and the fix.
    """
    schemes = {n: s for m in modifiers for n, s in m.quantizes().items()}
    gguf_modules = [n for n, s in schemes.items() if isinstance(s, GGUFScheme)]
    if output.output_format != "gguf":
        if gguf_modules and output.output_dir is not None:
            kind = schemes[gguf_modules[0]].gguf_mix or schemes[gguf_modules[0]].gguf_type
            raise ValueError(f"scheme {kind} is a GGUF format, which compressed-tensors checkpoints cannot hold; "
                             "pass output_format='gguf' (--output-format gguf)")  # fmt: skip
        return
    if other := [n for n in schemes if n not in gguf_modules]:
        raise ValueError(f"output_format='gguf': {other[0]} is quantized with {type(schemes[other[0]]).__name__} "
                         "weights llama.cpp cannot read; use a GGUF scheme (Q4_0, Q8_0, Q4_K_M, ...)")  # fmt: skip
    family = family_of(model.config)
    namer = tensor_namer(family, model.config)
    for name, _ in model.named_parameters():
        if namer(name) is None:
            raise ValueError(f"output_format='gguf': {name} has no llama.cpp tensor name in the {family.arch} "
                             "architecture; save a compressed-tensors checkpoint instead")  # fmt: skip
    head = model.get_output_embeddings()
    lm_head = next((n for n, m in model.named_modules() if m is head), None)
    if tied_output(model) and lm_head in schemes:
        raise ValueError(f"output_format='gguf': {lm_head} is tied to the token embedding, which llama.cpp stores "
                         f"once; add {lm_head!r} to ignore (the file gives it llama.cpp's output type)")  # fmt: skip
    check_tokenizer(tokenizer)
    path = Path(output.output_dir)
    if path.is_dir() and any(path.glob("*.safetensors")):
        raise ValueError(f"output_dir {path} holds a safetensors checkpoint; a model.gguf beside it would leave two "
                         "models in one directory: choose another output_dir")  # fmt: skip
