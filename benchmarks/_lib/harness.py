"""What the side-by-side benchmarks share: where things are, the two tools' runners, timing and perplexity.

The runners (``run_seqcal.py``, ``run_llmcompressor.py``) run as scripts in their tool's venv, in a subprocess
under GNU time; ``measure`` reports wall time, CPU time and the peak RSS of that process, ``perplexity`` the
WikiText-2 test perplexity of the checkpoint it wrote (in seqcal's venv, float32, 2048-token windows).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIB = "benchmarks/_lib"  # the runners, relative to ROOT (the commands run there)
WORK = ROOT / "benchmarks" / ".work"
WIKI = Path(os.environ.get("SEQCAL_BENCH_DATA", ROOT.parent / "shared" / "data"))  # WikiText-2 raw text
# the two venvs (relative to the repository root unless absolute): SEQCAL_BENCH_VENV / SEQCAL_BENCH_PEER_VENV
VENV = os.environ.get("SEQCAL_BENCH_VENV", ".venv")
SEQCAL = [f"{VENV}/bin/python", f"{LIB}/run_seqcal.py"]
PEER = [
    f"{os.environ.get('SEQCAL_BENCH_PEER_VENV', '.peer-venv')}/bin/python",
    f"{LIB}/run_llmcompressor.py",
]


def measure(cmd: list[str], log: Path | None = None) -> tuple[float, float, float, str]:
    """Run ``cmd`` under GNU time; returns (wall s, cpu s, peak RSS in GB, the tool's last output line).

    Args:
        log: a file for the tool's whole output (its per-layer losses, warnings), stdout then stderr.
    """
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{' '.join(cmd)} failed with {proc.returncode}")
    stats = dict(line.strip().rsplit(": ", 1) for line in proc.stderr.splitlines() if ": " in line)
    cpu = float(stats["User time (seconds)"]) + float(stats["System time (seconds)"])
    rss_gb = int(stats["Maximum resident set size (kbytes)"]) * 1024 / 1e9
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return wall, cpu, rss_gb, last


def calibration_tokens(model: Path, samples: int, seq: int) -> Path:
    """The calibration windows every tool of a comparison gets: the first ``samples`` shuffled ``seq``-token windows
    of WikiText-2 valid (``calib_tokens.py``), made once under ``WORK`` and reused by later runs."""
    WORK.mkdir(parents=True, exist_ok=True)
    tokens = WORK / f"calib_{samples}x{seq}.safetensors"
    if not tokens.exists():
        subprocess.run([f"{VENV}/bin/python", "benchmarks/_lib/calib_tokens.py", "--model", str(model), "--text",
                        str(WIKI / "wiki.valid.raw"), "--samples", str(samples), "--seq", str(seq),
                        "--out", str(tokens)], cwd=ROOT, check=True)  # fmt: skip
    return tokens


def perplexity(checkpoint: Path, windows: int | None) -> float:
    code = (
        "import sys, torch; from transformers import AutoTokenizer;"
        "from seqcal.evaluation.loading import load_causal_lm;"
        "from seqcal.evaluation.perplexity import perplexity, load_eval_text;"
        f"m = load_causal_lm({str(checkpoint)!r}, torch.float32);"
        f"t = AutoTokenizer.from_pretrained({str(checkpoint)!r});"
        f"r = perplexity(m, t, load_eval_text({str(WIKI / 'wiki.test.raw')!r}), seq_len=2048, "
        f"max_windows={windows!r}, progress=False); print(r.ppl, r.windows)"
    )
    out = subprocess.run(
        [f"{VENV}/bin/python", "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[-2])


def run_and_evaluate(name: str, cmd: list[str], out: Path, eval_windows: int | None, evaluate: bool = True,
                     width: int = 18) -> dict:  # fmt: skip
    """Run one tool's command under ``measure``, evaluate the checkpoint it wrote to ``out``, print one row.

    Returns:
        ``{wall_s, cpu_s, peak_rss_gb, ppl, tool_reported}`` (ppl NaN when ``evaluate`` is False).
    """
    wall, cpu, rss, last = measure(cmd)
    ppl = perplexity(out, eval_windows) if evaluate else float("nan")
    print(
        f"{name:<{width}} wall {wall:7.1f} s  cpu {cpu:7.1f} s  peak RSS {rss:5.2f} GB  ppl {ppl:7.2f}",
        flush=True,
    )
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "peak_rss_gb": round(rss, 2), "ppl": round(ppl, 2),
            "tool_reported": last}  # fmt: skip
