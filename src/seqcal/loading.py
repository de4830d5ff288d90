"""``load_model``: what the user passed as the model -> the model, its tokenizer and where its weights are.

A directory's weights stay on disk with ``offload_weights`` (the sequential pipeline's default): parameters on
meta and a ``WeightStore`` that reads each subgraph's. A quantized checkpoint (FP8, MXFP4, compressed-tensors,
AutoAWQ, GPTQ; ``seqcal.sources``) is always read through the store, its weights dequantized one at a time;
loaded into RAM, it is the store's values put in place (the same values as offloaded, bit for bit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from seqcal.data.checks import TOKENIZER_FILES, check_model_dir
from seqcal.errors import ModelLoadError
from seqcal.execution.store import WeightStore, load_offloaded, restore_in_memory
from seqcal.plan.host import HostBudgetError, check_whole_load
from seqcal.plan.values import PROCESS_BASELINE
from seqcal.run_args import DTYPES, ModelArgs
from seqcal.sources.checkpoint import source_format


def load_model(
    args: ModelArgs, offload_weights: bool = False, host_budget: int | None = None
) -> tuple[torch.nn.Module, Any, WeightStore | None]:
    """The model (eval mode), its tokenizer and, with ``offload_weights``, the store of its weights.

    With ``offload_weights`` (the default of the sequential pipeline for a directory) no weight is read
    here: parameters stay on meta and each subgraph reads its own from the safetensors files. Without it,
    a ``host_budget`` (bytes) smaller than the weights on disk is refused before they are read.

    Example:
        >>> model, tokenizer, store = load_model(ModelArgs("out/llama"), offload_weights=True)  # doctest: +SKIP
    """
    from transformers import AutoTokenizer

    from seqcal.models import detach_from_files, resolve_model
    from seqcal.multimodal.classes import from_pretrained

    store = None
    if isinstance(args.model, torch.nn.Module):
        model, source = args.model, getattr(args.model, "name_or_path", None)
    else:
        source = str(resolve_model(args.model, args.revision, args.trust_remote_code))
        check_model_dir(source)
        dtype = DTYPES[args.dtype]
        try:
            if offload_weights or source_format(source) is not None:
                model, store = load_offloaded(
                    source, None if dtype == "auto" else dtype, args.trust_remote_code
                )
                if not offload_weights:  # a quantized source in RAM: its weights dequantized by the store
                    check_dequantized_load(model, source, host_budget)
                    restore_in_memory(model, store)
                    store = None
            else:
                check_whole_load(source, host_budget)
                model = from_pretrained(source, dtype, args.trust_remote_code)
                detach_from_files(model)  # else the checkpoint's pages stay beside each replaced weight
        except HostBudgetError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises, the checkpoint is the cause
            raise ModelLoadError.wrap(source, exc) from exc
    tokenizer = args.tokenizer
    if isinstance(tokenizer, (str, Path)):  # a directory or Hub id, resolved by transformers itself
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=args.trust_remote_code)
    if tokenizer is None and source and any((Path(source) / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    return model.eval(), tokenizer, store


def check_dequantized_load(model: torch.nn.Module, source: str, budget: int | None) -> None:
    """Refuse a quantized checkpoint loaded whole into RAM whose dequantized weights exceed ``budget``.

    Why not ``check_whole_load``: it counts the files on disk, which hold an FP8 weight in half (a 4-bit one in a
    quarter) of what its dequantized form takes in RAM; the model's parameters (on meta) give the right count.
    """
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if budget is not None and size + PROCESS_BASELINE > budget:
        raise HostBudgetError(
            f"max_host_memory={budget / 1e9:.2f} GB cannot be kept: the quantized model in {source} is loaded "
            f"whole into RAM (no output_dir) and its dequantized weights alone take {size / 1e9:.2f} GB; pass "
            "output_dir to read them per subgraph, or raise max_host_memory"
        )
