"""Evaluation: WikiText-2 perplexity and the per-layer error report of a quantization run.

Perplexity follows the protocol of GPTQ's ``llama_eval`` / ``opt_eval`` (and of the PTQ papers and tools
that copy it): the test split's rows joined with ``"\\n\\n"``, tokenized once with the tokenizer's defaults,
cut into non-overlapping windows of ``seq_len`` tokens (the last partial window dropped), each window
scored on its own, ``nll`` = mean next-token cross-entropy over every predicted token of every window and
``ppl = exp(nll)``. Numbers are comparable with published GPTQ-style WikiText-2 perplexities, not with
lm-eval's ``wikitext`` task (word perplexity per document, rolling windows).

The text and its windows (``load_eval_text``, ``token_windows``) live in ``seqcal.evaluation.text``, the per-layer
error report (``format_error_table``, ``write_error_report``) in ``seqcal.evaluation.errors``; both are re-exported
here.

Example:
    >>> text = load_eval_text("../shared/data/wiki.test.raw")
    >>> result = perplexity(model, tokenizer, text, seq_len=2048)
    >>> print(result.summary())
    ppl 21.62 (nll 3.0735) over 148 windows x 2048 tokens in 2708.9 s
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from seqcal.evaluation.errors import REPORT_FILENAME, format_error_table, write_error_report
from seqcal.evaluation.text import load_eval_text, token_windows

__all__ = [
    "DTYPES",
    "REPORT_FILENAME",
    "PerplexityResult",
    "format_error_table",
    "load_eval_text",
    "perplexity",
    "token_windows",
    "window_nll_sum",
    "write_error_report",
]

logger = logging.getLogger(__name__)


# Names accepted for `perplexity(dtype=...)`; torch.dtype objects are accepted as well.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}

# Logit elements upcast to fp32 at a time: 2**24 floats = 64 MiB, about 340 positions of a 49k vocab.
_LOSS_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class PerplexityResult:
    """Outcome of :func:`perplexity`.

    Attributes:
        ppl: ``exp(nll)``.
        nll: mean next-token cross-entropy (nats) over all predicted tokens.
        tokens: predicted tokens, ``windows * (seq_len - 1)``: the first token of a window has no context.
        windows: windows of ``seq_len`` tokens scored.
        seq_len: tokens per window.
        seconds: wall time of the call (tokenization included).
    """

    ppl: float
    nll: float
    tokens: int
    windows: int
    seq_len: int
    seconds: float

    def __post_init__(self) -> None:
        # NaN nll passes: a broken model's NaN loss is reported, not hidden.
        ok = self.seq_len >= 2 and self.windows >= 1 and not (self.nll < 0 or self.seconds < 0)
        if not ok or self.tokens != self.windows * (self.seq_len - 1):
            raise ValueError(
                f"PerplexityResult: inconsistent {self}; expected seq_len >= 2, windows >= 1, nll >= 0, "
                "seconds >= 0 and tokens == windows * (seq_len - 1) (a window predicts all but its first token)."
            )

    def summary(self) -> str:
        """One line for logs and the CLI, e.g. ``ppl 21.62 (nll 3.0736) over 8 windows x 2048 tokens in 60.1 s``."""
        return (
            f"ppl {self.ppl:.2f} (nll {self.nll:.4f}) over {self.windows} windows x {self.seq_len} tokens "
            f"in {self.seconds:.1f} s"
        )


# ---- perplexity ----------------------------------------------------------------------------------------


def window_nll_sum(
    logits: torch.Tensor, input_ids: torch.Tensor, *, chunk_rows: int | None = None
) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy of windows, upcast to fp32 a chunk of positions at a time.

    Position ``t`` predicts token ``t + 1``: a window of ``T`` tokens scores ``T - 1``. Upcasting a chunk at
    a time keeps a bf16 model's logits from getting a full fp32 copy (400 MB per 2048 x 49152 window).

    Args:
        logits: ``(B, T, V)``, any float dtype; input_ids: ``(B, T)``, the windows scored.
        chunk_rows: positions upcast at a time; None picks about 2**24 logit elements per chunk.

    Returns:
        (float64 scalar sum of the token losses, on the logits' device; ``B * (T - 1)``).

    Example:
        >>> total, count = window_nll_sum(model(input_ids=ids).logits, ids)
        >>> ppl = math.exp(total.item() / count)
    """
    batch, length, vocab = logits.shape
    if tuple(input_ids.shape) != (batch, length):
        raise ValueError(
            f"seqcal.evaluation.perplexity.window_nll_sum: logits {tuple(logits.shape)} need input_ids of shape "
            f"{(batch, length)}, got {tuple(input_ids.shape)}."
        )
    rows = chunk_rows or max(1, _LOSS_CHUNK_ELEMENTS // vocab)
    input_ids = input_ids.to(logits.device)
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for b in range(batch):
        for start in range(0, length - 1, rows):
            stop = min(start + rows, length - 1)
            chunk = logits[b, start:stop].float()  # (c, V): only this slice is copied to fp32
            targets = input_ids[b, start + 1 : stop + 1]  # (c,): the next tokens
            total += F.cross_entropy(chunk, targets, reduction="sum").double()
    return total, batch * (length - 1)


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None:
        return None
    resolved = dtype if isinstance(dtype, torch.dtype) else DTYPES.get(str(dtype))
    if resolved is None or not resolved.is_floating_point:
        raise ValueError(
            f"seqcal.evaluation.perplexity: dtype {dtype!r} is not a floating dtype; valid names: {sorted(DTYPES)} "
            "(or a floating torch.dtype, or None to keep the model's dtype)."
        )
    return resolved


def perplexity(
    model: torch.nn.Module,
    tokenizer: Any,
    text: str,
    *,
    seq_len: int = 2048,
    batch_size: int = 1,
    max_windows: int | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """Perplexity of a causal LM on ``text`` with the GPTQ WikiText-2 protocol (see the module docstring).

    Windows are scored independently, without KV cache, under ``torch.inference_mode``, in eval mode (the
    model's train/eval mode is restored afterwards); the loss is computed in fp32 whatever the model dtype.

    Args:
        model: a causal LM whose output has ``.logits`` ``(B, T, V)``; tokenizer: its tokenizer.
        text: evaluation text, e.g. ``load_eval_text("wiki.test.raw")``.
        seq_len: tokens per window; batch_size: windows per forward pass (the result does not depend on it).
        max_windows: score only the first this many windows (quick checks); None scores all.
        device, dtype: None runs the model where and as it is; otherwise it is moved / cast in place, as
            ``model.to`` does (dtype: a torch.dtype or a name in ``DTYPES``).
        progress: show a tqdm bar over batches.

    Returns:
        :class:`PerplexityResult`. Raises ValueError on bad arguments, a text shorter than one window, or
        ``device``/``dtype`` given for a model dispatched across devices (``hf_device_map``).

    Example:
        >>> model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        >>> tokenizer = AutoTokenizer.from_pretrained(path)
        >>> round(perplexity(model, tokenizer, load_eval_text("wiki.test.raw"), max_windows=8).ppl, 2)
        19.13
    """
    _check_perplexity_args(seq_len, batch_size, max_windows)
    start = time.perf_counter()
    windows = token_windows(tokenizer, text, seq_len, max_windows)  # (W, T)
    run_device = _place_model(model, device, _resolve_dtype(dtype))
    was_training = model.training
    model.eval()
    try:
        total, count = _score_windows(model, windows, batch_size, run_device, progress)
    finally:
        model.train(was_training)
    nll = total / count
    result = PerplexityResult(
        ppl=math.inf if nll > 700 else math.exp(nll),  # exp overflows past ~709; NaN stays NaN
        nll=nll,
        tokens=count,
        windows=windows.shape[0],
        seq_len=seq_len,
        seconds=time.perf_counter() - start,
    )
    logger.info("seqcal.evaluation.perplexity: %s", result.summary())
    return result


def _check_perplexity_args(seq_len: int, batch_size: int, max_windows: int | None) -> None:
    problems = []
    if seq_len < 2:
        problems.append(f"seq_len={seq_len} (>= 2: a window needs a token to predict)")
    if batch_size < 1:
        problems.append(f"batch_size={batch_size} (>= 1)")
    if max_windows is not None and max_windows < 1:
        problems.append(f"max_windows={max_windows} (>= 1, or None for all windows)")
    if problems:
        raise ValueError(f"seqcal.evaluation.perplexity.perplexity: invalid {', '.join(problems)}.")


def _place_model(model: torch.nn.Module, device: Any, dtype: torch.dtype | None) -> torch.device:
    """Move/cast the model as asked; return the device its input ids must be on."""
    if device is None and dtype is None:
        return _input_device(model)
    if getattr(model, "hf_device_map", None):
        raise ValueError(
            "seqcal.evaluation.perplexity.perplexity: the model is dispatched across devices (it has an hf_device_map), so "
            "it cannot be moved or cast as a whole; pass device=None and dtype=None to evaluate it in place."
        )
    model.to(device=device, dtype=dtype)
    return _input_device(model)


def _input_device(model: torch.nn.Module) -> torch.device:
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    # accelerate-dispatched modules hold weights elsewhere (meta/cpu) and run on the hook's device.
    hook_device = getattr(getattr(embed, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(hook_device)
    weight = getattr(embed, "weight", None)
    if weight is None:
        weight = next(model.parameters(), None)
    if weight is None or weight.device.type == "meta":
        return torch.device("cpu")
    return weight.device


def _score_windows(
    model: torch.nn.Module, windows: torch.Tensor, batch_size: int, device: torch.device, progress: bool
) -> tuple[float, int]:
    """Summed token NLL and token count over all windows."""
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    batches = windows.split(batch_size)
    with torch.inference_mode():
        for batch in tqdm(batches, desc="perplexity", unit="batch", disable=not progress):
            batch = batch.to(device)  # (B, T)
            output = model(input_ids=batch, use_cache=False)
            logits = output[0] if isinstance(output, tuple) else getattr(output, "logits", None)
            if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
                raise TypeError(
                    f"seqcal.evaluation.perplexity.perplexity: {type(model).__name__} returned no (batch, seq, vocab) logits; "
                    "pass a causal LM with its head, e.g. one loaded with AutoModelForCausalLM."
                )
            batch_total, batch_count = window_nll_sum(logits, batch)
            total += batch_total.cpu()
            count += batch_count
    return total.item(), count
