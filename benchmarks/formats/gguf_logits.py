"""llama.cpp's logits of a GGUF file against the PyTorch model holding the file's own weights, on 8 windows.

For seqcal's files the PyTorch model is seqcal's fake-quantized model: the writer requires every quantized tensor,
as gguf-py dequantizes it, to equal the calibrated module's weight (``seqcal.gguf.tensors``), and transformers'
GGUF loader builds the model from that dequantization. What remains between the two is llama.cpp's arithmetic:
on the CPU its quantized matmuls round the activations to 8 bits per block (Q8_K / Q8_0) before the dot product.

llama.cpp's side: ``llama-perplexity --kl-divergence-base`` on the first ``--windows`` windows of ``--ctx`` tokens
of WikiText-2 test, which saves the tokens it read and, for the second half of each window, every token's log-prob
(uint16 steps of at most 16/65535 nats over the 16 nats below the top token; lower ones are not kept). PyTorch's
side: the same tokens (a BOS first where the file's vocabulary adds one, as llama.cpp does), float32.

Measured per file: mean and largest KL(llama.cpp || PyTorch) per position, the largest change of the next token's
log-prob (the NLL each perplexity sums) and of any kept log-prob above -10, and how often the top token agrees.
The tolerance is llama.cpp's own: the same comparison for ``llama-quantize``'s file of the same mix (``--control``)
shows what llama.cpp's kernels give on a file whose exact values are known; a file passes when its mean KL and
its largest NLL change are within ``--factor`` times the control's. A cross row (llama.cpp on the first file
against PyTorch with the control's weights) shows the size of a real difference in the weights.

Usage (from the repo root, after gguf_llamacpp.py made the files):
    .venv/bin/python benchmarks/formats/gguf_logits.py [--files f32,seqcal-gptq-Q4_K_M,...]
        [--control llama-Q4_K_M] [--windows 8] [--ctx 512] [--threads 2]
    .venv/bin/python benchmarks/formats/gguf_logits.py --bytes seqcal-rtn-Q4_K_M,llama-Q4_K_M
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gguf_llamacpp, beside this file
from gguf_llamacpp import BIN, OUT, TEST_TEXT  # noqa: E402

CUTOFF = -10.0  # log-probs compared entry by entry: those above it (below, the 16-nat window may clip them)


def dump(name: str, args: argparse.Namespace) -> Path:
    """llama.cpp's log-probs of the row's file on the windows (``--kl-divergence-base``), made once."""
    path = OUT / name / f"logits_{args.windows}x{args.ctx}.bin"
    if not path.exists():
        cmd = [str(BIN / "llama-perplexity"), "-m", str(OUT / name / "model.gguf"), "-f", str(TEST_TEXT), "-c",
               str(args.ctx), "-b", str(args.ctx), "--chunks", str(args.windows), "-t", str(args.threads),
               "--kl-divergence-base", str(path), *([] if args.repack else ["--no-repack"])]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (path.parent / f"logits_{args.windows}x{args.ctx}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {path.parent}")
    return path


def read_dump(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [windows, ctx], log-probs [windows, ctx - 1 - ctx // 2, vocab] with -inf where not kept)."""
    raw = path.read_bytes()
    if raw[:8] != b"_logits_":
        raise SystemExit(f"{path} is not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(raw, np.int32, 3, 8))
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, 20).reshape(n_chunk, n_ctx)
    nv, rows = 2 * ((n_vocab + 1) // 2) + 4, n_ctx - 1 - n_ctx // 2
    body = np.frombuffer(raw, np.uint16, n_chunk * rows * nv, 20 + 4 * n_chunk * n_ctx).reshape(
        n_chunk, rows, nv
    )
    head = body[..., :4].copy().view(np.float32)  # [scale, min_log_prob] per row
    q = body[..., 4 : 4 + n_vocab].astype(np.float32)
    logp = head[..., 1:2] + head[..., 0:1] * q
    logp[q == 0] = -np.inf  # below the kept window (or its floor): not compared
    return tokens, logp


def torch_logprobs(name: str, tokens: np.ndarray) -> torch.Tensor:
    """PyTorch's log-probs [windows, ctx - 1 - ctx // 2, vocab] from the file's weights (gguf-py's values)."""
    import gguf
    from transformers import AutoModelForCausalLM

    folder = OUT / name
    reader = gguf.GGUFReader(folder / "model.gguf")
    field = reader.fields.get("tokenizer.ggml.add_bos_token")
    ids = torch.from_numpy(tokens.astype(np.int64))
    if field is not None and bool(field.parts[field.data[0]][0]):
        bos = reader.fields["tokenizer.ggml.bos_token_id"]
        ids[:, 0] = int(bos.parts[bos.data[0]][0])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32).eval()
    first = tokens.shape[1] // 2
    with torch.inference_mode():
        out = [torch.log_softmax(model(row[None]).logits[0, first:-1].float(), -1) for row in ids]
    return torch.stack(out)


def compare(cpp: np.ndarray, tokens: np.ndarray, pt: torch.Tensor) -> dict:
    """How far llama.cpp's log-probs are from PyTorch's (see the module's docstring for each figure)."""
    first = tokens.shape[1] // 2
    kls, d_nlls, d_high, agree = [], [], [], []
    for w in range(cpp.shape[0]):  # one window at a time: a window's [positions, vocab] floats are 50 MB each
        c, t = torch.from_numpy(cpp[w]), pt[w]
        kept = torch.isfinite(c)
        kls.append(
            (torch.where(kept, c.exp(), 0.0) * torch.where(kept, c - t, 0.0)).sum(-1)
        )  # kept entries only
        nxt = torch.from_numpy(tokens[w, first + 1 :].astype(np.int64))[:, None]
        d = (c.gather(-1, nxt) - t.gather(-1, nxt)).squeeze(-1)
        d_nlls.append(d[torch.isfinite(d)])
        d_high.append((c - t)[kept & (c > CUTOFF)].abs().max())
        agree.append((c.argmax(-1) == t.argmax(-1)).float())
    kl, d_nll, agree_all = torch.cat(kls), torch.cat(d_nlls), torch.cat(agree)
    return {"positions": int(kl.numel()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "nll_max_abs_diff": float(d_nll.abs().max()), "nll_mean_diff": float(d_nll.mean()),
            "logp_max_abs_diff": float(torch.stack(d_high).max()), "top1_agree": float(agree_all.mean())}  # fmt: skip


def same_tensors(a: str, b: str) -> dict:
    """Which tensors two rows' files hold in the same type and the same bytes (e.g. seqcal's round to nearest
    against llama-quantize without an importance matrix, which round the same weights on the same grids)."""
    import gguf

    ta = {t.name: t for t in gguf.GGUFReader(OUT / a / "model.gguf").tensors}
    tb = {t.name: t for t in gguf.GGUFReader(OUT / b / "model.gguf").tensors}
    same, differ = 0, []
    for name in sorted(set(ta) | set(tb)):
        x, y = ta.get(name), tb.get(name)
        ok = x is not None and y is not None and x.tensor_type == y.tensor_type
        if ok and np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)):
            same += 1
        else:
            differ.append(f"{name} ({x.tensor_type.name if x else '-'} / {y.tensor_type.name if y else '-'})")
    return {"files": f"{a} / {b}", "same": same, "differ": len(differ), "first_differing": differ[:8]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", default="f32,seqcal-gptq-Q4_K_M,seqcal-gptq-Q4_0,llama-Q4_0")
    parser.add_argument("--control", default="llama-Q4_K_M")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repack", action="store_true", help="let llama.cpp repack (gguf_llamacpp.py's --repack)")
    parser.add_argument(
        "--bytes", default=None, metavar="A,B", help="only compare two rows' tensors byte for byte"
    )
    parser.add_argument(
        "--factor", type=float, default=2.0, help="allowed multiple of the control's deviation"
    )
    args = parser.parse_args()
    if args.bytes:
        print(json.dumps(same_tensors(*args.bytes.split(",")), indent=1))
        return
    torch.set_num_threads(args.threads)
    names = [args.control, *[n for n in args.files.split(",") if n != args.control]]
    results, control_pt = {}, None
    for name in names:
        tokens, cpp = read_dump(dump(name, args))
        pt = torch_logprobs(name, tokens)
        results[name] = compare(cpp, tokens, pt)
        if name == args.control:
            control_pt = pt
        elif name.startswith("seqcal-") and not any(k.startswith("cross") for k in results):
            results[f"cross: llama.cpp on {name}, PyTorch on {args.control}"] = compare(
                cpp, tokens, control_pt
            )
        del pt, cpp
    ref = results[args.control]
    for name, row in results.items():
        row["within"] = (row["kl_mean"] <= args.factor * ref["kl_mean"]
                         and row["nll_max_abs_diff"] <= args.factor * ref["nll_max_abs_diff"])  # fmt: skip
        print(f"{name:<52} KL mean {row['kl_mean']:.2e} max {row['kl_max']:.2e}  |dNLL| max "
              f"{row['nll_max_abs_diff']:.4f}  |dlogp|>{CUTOFF:g} max {row['logp_max_abs_diff']:.4f}  top-1 "
              f"{100 * row['top1_agree']:.2f}%  {'within' if row['within'] else 'OUTSIDE'} {args.factor:g}x control")  # fmt: skip
    (OUT / f"logits_{args.windows}x{args.ctx}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
