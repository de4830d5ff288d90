"""Two checkpoints' perplexities compared window by window: is the difference larger than the windows' spread?

Perplexity on a few windows moves with the windows: two models 0.3% apart on 8 windows may swap places on the
next 8. Each checkpoint's mean next-token NLL is measured per 2048-token window of WikiText-2 test (the windows of
``seqcal.evaluation.perplexity``, fp32, each scored on its own); the difference of the two per window, its mean and
its standard error over the windows (a paired comparison: what both models find hard cancels) say whether one is
lower beyond the windows' noise. Per-window NLLs are kept in ``.work/paired_ppl/<name>.json``, so a checkpoint is
scored once.

Usage (from the repo root):
    .venv/bin/python benchmarks/peers/paired_ppl.py A_DIR B_DIR [--windows 40] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
from harness import WIKI, WORK  # noqa: E402

CACHE = WORK / "paired_ppl"


def window_nlls(checkpoint: Path, windows: int) -> list[float]:
    """Mean next-token NLL (nats) of each of the first ``windows`` 2048-token windows, cached by path and count."""
    key = hashlib.sha1(f"{checkpoint.resolve()}:{windows}".encode()).hexdigest()[:12]
    path = CACHE / f"{checkpoint.name}-{key}.json"
    if path.exists():
        return json.loads(path.read_text())["nll"]
    import torch
    from transformers import AutoTokenizer

    from seqcal.evaluation.loading import load_causal_lm
    from seqcal.evaluation.perplexity import load_eval_text, token_windows, window_nll_sum

    model = load_causal_lm(str(checkpoint), torch.float32).eval()
    ids = token_windows(AutoTokenizer.from_pretrained(checkpoint), load_eval_text(WIKI / "wiki.test.raw"), 2048,
                        windows)  # fmt: skip
    out = []
    with torch.inference_mode():
        for i, window in enumerate(ids):
            total, count = window_nll_sum(model(input_ids=window[None]).logits, window[None])
            out.append(total.item() / count)
            print(f"  {checkpoint.name} window {i + 1}/{len(ids)}: nll {out[-1]:.4f}", flush=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"checkpoint": str(checkpoint), "windows": windows, "nll": out}))
    return out


def compare(a: list[float], b: list[float]) -> dict:
    """Perplexities of both, and the per-window difference ``b - a``: its mean, standard error, and wins of b."""
    diff = [y - x for x, y in zip(a, b, strict=True)]
    n = len(diff)
    mean = sum(diff) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diff) / (n - 1) / n) if n > 1 else math.nan
    return {"windows": n, "ppl_a": math.exp(sum(a) / n), "ppl_b": math.exp(sum(b) / n), "mean_diff": mean,
            "se": se, "z": mean / se if se > 0 else math.nan, "b_lower_in": sum(d < 0 for d in diff)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    r = compare(window_nlls(args.a, args.windows), window_nlls(args.b, args.windows))
    print(f"{args.a.name}: ppl {r['ppl_a']:.3f}   {args.b.name}: ppl {r['ppl_b']:.3f}   over {r['windows']} windows")
    print(f"per-window NLL, b - a: mean {r['mean_diff']:+.5f} nats, standard error {r['se']:.5f} (z {r['z']:+.2f}); "
          f"b lower in {r['b_lower_in']} of {r['windows']} windows")  # fmt: skip
    print(json.dumps(r))


if __name__ == "__main__":
    main()
