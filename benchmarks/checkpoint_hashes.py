"""SHA-256 of the checkpoints `seqcal oneshot` writes for four recipes: a guard for byte-identical refactors.

Runs the command line (``python -m seqcal.cli oneshot`` with this checkout's ``src`` on ``PYTHONPATH``) on
SmolLM2-135M-Instruct (``--model default``) in float32, one recipe after the other (GPTQ W4A16 g64, AWQ W4A16
g64, SmoothQuant + GPTQ W8A8, GPTQ NVFP4), on a small fixed
calibration set: WikiText-2 validation (``../shared/data/wiki.valid.raw`` beside the repository) when it is
there, else the calibration text embedded in seqcal. It records the SHA-256 of every checkpoint file whose
bytes matter (each safetensors file whole and tensor by tensor, ``config.json``'s ``quantization_config``,
the rest of ``config.json``, the index, tokenizer and recipe files; not ``quantization_report.json``, which
holds timings) in ``benchmarks/checkpoint_hashes.json``, with the exact command lines, the thread count, the
torch version and the CPU, since the bytes depend on them.

``--check`` reruns the recorded command lines with the recorded settings, compares, prints per recipe
``same`` or ``different`` (with the tensors that differ, by name) and exits 1 on any difference::

    .venv/bin/python benchmarks/checkpoint_hashes.py            # record the baseline (about 4 runs of a minute
                                                                # or two each on an idle 2-core CPU)
    .venv/bin/python benchmarks/checkpoint_hashes.py --check    # after the change: same bytes?
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "checkpoint_hashes.json"
WORK = ROOT / "benchmarks" / ".work" / "checkpoint_hashes"
WIKITEXT = "../shared/data/wiki.valid.raw"  # relative to the repository root, the runs' working directory

RECIPES = {
    "gptq_w4a16_g64": "recipes/gptq_w4a16_g64.yaml",
    "awq_w4a16_g64": "{work}/awq_w4a16_g64.yaml",  # written from WRITTEN_RECIPES before the run
    "smoothquant_gptq_w8a8": "recipes/smoothquant_gptq_w8a8.yaml",
    "gptq_nvfp4": "recipes/gptq_nvfp4.yaml",
}
# recipes/awq_w4a16.yaml (groups of 128) does not divide SmolLM2's 576 inputs, and seqcal refuses it; the same
# AWQ recipe with groups of 64, as the benchmarks run AWQ on SmolLM2:
WRITTEN_RECIPES = {
    "awq_w4a16_g64": """quant_stage:
  quant_modifiers:
    AWQModifier:
      duo_scaling: both
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 64}
""",
}
# Files of a checkpoint left out, with why: their bytes change from run to run without the model changing.
SKIPPED = {
    "quantization_report.json": "holds timings",
    "quantization_errors.png": "a plot (the runs pass --plot none)",
}


@dataclass(frozen=True)
class Settings:
    """What the runs' bytes depend on besides the code.

    Args:
        samples: calibration samples (``--num-calibration-samples``).
        seq_len: tokens per sample at most (``--max-seq-length``).
        threads: ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` of each run.
        dataset: ``--dataset``: a path relative to the repository root, or ``default`` (the embedded text).
    """

    samples: int = 8
    seq_len: int = 128
    threads: int = 2
    dataset: str = "default"

    def __post_init__(self) -> None:
        for name in ("samples", "seq_len", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Settings.{name} must be a positive int, got {value!r}; e.g. {name}=2")


def command(recipe: str, settings: Settings, output_dir: str) -> list[str]:
    """The ``seqcal oneshot`` arguments of one run (after ``python -m seqcal.cli``).

    Args:
        recipe: recipe path relative to the repository root.
        settings: calibration size, threads and data.
        output_dir: where the checkpoint goes.

    Returns:
        The argument list.
    """
    return ["oneshot", "--model", "default", "--recipe", recipe, "--dataset", settings.dataset,
            "--num-calibration-samples", str(settings.samples), "--max-seq-length", str(settings.seq_len),
            "--dtype", "float32", "--batch-size", "1", "--plot", "none",
            "--output-dir", output_dir, "--overwrite", "-q"]  # fmt: skip


def run_env(settings: Settings) -> dict[str, str]:
    """The environment of a run: this checkout's ``src`` first on ``PYTHONPATH``, offline, fixed threads."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(settings.threads)
    return env


_ENV_PROBE = """
import json, platform, torch, transformers, compressed_tensors, seqcal
try:
    from seqcal.backend.onednn import use_onednn
except ImportError:  # the code before the package layout change (e.g. 50e74bd, the record's commit)
    from seqcal.algorithms.products import use_onednn
cpu = next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')), '')
print(json.dumps({'torch': torch.__version__, 'threads': torch.get_num_threads(),
    'transformers': transformers.__version__, 'compressed_tensors': compressed_tensors.__version__,
    'python': platform.python_version(), 'cpu': cpu or platform.processor(),
    'float32_products': 'oneDNN' if use_onednn() else 'torch', 'seqcal': seqcal.__file__}))
"""


def environment(settings: Settings) -> dict[str, object]:
    """Versions, thread count and CPU as a run sees them (a child with the runs' environment).

    Args:
        settings: the threads to ask for.

    Returns:
        ``torch``, ``threads``, ``transformers``, ``compressed_tensors``, ``python``, ``cpu``,
        ``float32_products`` (oneDNN or torch's own kernels) and ``machine``.
    """
    proc = subprocess.run([sys.executable, "-c", _ENV_PROBE], env=run_env(settings), cwd=ROOT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    found = json.loads(proc.stdout)
    seqcal_file = Path(found.pop("seqcal"))
    if not seqcal_file.is_relative_to(ROOT / "src"):
        raise RuntimeError(f"the runs would import seqcal from {seqcal_file}, not from {ROOT / 'src'}; "
                           "unset PYTHONPATH entries that hold another seqcal")  # fmt: skip
    return {**found, "machine": platform.machine()}


def source_commit() -> str:
    """The last commit that changed ``src/`` (the code the runs import), with ``+changes`` when it is edited."""
    head = subprocess.run(
        ["git", "log", "-1", "--format=%h", "--", "src"], cwd=ROOT, capture_output=True, text=True
    )
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tensor_hashes(path: Path) -> dict[str, str]:
    """SHA-256 of each tensor of a safetensors file, with its dtype and shape, and of the header's metadata.

    Args:
        path: a ``.safetensors`` file.

    Returns:
        ``{name: "DTYPE[shape] sha256"}``, and ``__metadata__`` when the header has one.
    """
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    found = {}
    if "__metadata__" in header:
        found["__metadata__"] = sha256(json.dumps(header.pop("__metadata__"), sort_keys=True).encode())
    for name, entry in sorted(header.items()):
        begin, end = entry["data_offsets"]
        found[name] = f"{entry['dtype']}{entry['shape']} {sha256(data[8 + size + begin : 8 + size + end])}"
    return found


def checkpoint_hashes(directory: Path) -> dict[str, dict[str, str]]:
    """The hashes of one checkpoint directory.

    Args:
        directory: a finished ``seqcal oneshot`` output directory.

    Returns:
        ``{"files": {name: sha256}, "tensors": {name: "DTYPE[shape] sha256"}}`` (each shard's header
        metadata as ``SHARD:__metadata__``); ``config.json`` is
        split into ``config.json:quantization_config`` and ``config.json:rest`` (canonical JSON each).
    """
    files, tensors = {}, {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        if name in SKIPPED:
            continue
        if name == "config.json":
            config = json.loads(path.read_text(encoding="utf-8"))
            quant = config.pop("quantization_config", None)
            files["config.json:quantization_config"] = sha256(json.dumps(quant, sort_keys=True).encode())
            files["config.json:rest"] = sha256(json.dumps(config, sort_keys=True).encode())
            continue
        files[name] = sha256(path.read_bytes())
        if name.endswith(".safetensors"):
            found = tensor_hashes(
                path
            )  # tensor names are unique across shards; the index says which holds which
            if "__metadata__" in found:
                found[f"{name}:__metadata__"] = found.pop("__metadata__")
            tensors.update(found)
    return {"files": files, "tensors": tensors}


def run_recipe(name: str, settings: Settings, work: Path) -> tuple[str, dict, float]:
    """Quantize with one recipe and hash the checkpoint.

    Args:
        name: a key of ``RECIPES``.
        settings: calibration size, threads and data.
        work: folder of the checkpoints (one subfolder per recipe).

    Returns:
        The command line (output folder written as ``{work}``), the hashes, the wall seconds.
    """
    out = work / name
    if name in WRITTEN_RECIPES:
        work.mkdir(parents=True, exist_ok=True)
        (work / f"{name}.yaml").write_text(WRITTEN_RECIPES[name], encoding="utf-8")
    args = command(RECIPES[name].format(work=work), settings, str(out))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "seqcal.cli", *args], env=run_env(settings), cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: seqcal oneshot exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    shown = [a.replace(str(work), "{work}") for a in args]
    line = f"OMP_NUM_THREADS={settings.threads} MKL_NUM_THREADS={settings.threads} HF_HUB_OFFLINE=1 " \
           f"PYTHONPATH=src python -m seqcal.cli {shlex.join(shown)}"  # fmt: skip
    return line, checkpoint_hashes(out), seconds


def differences(recorded: dict[str, dict[str, str]], now: dict[str, dict[str, str]]) -> list[str]:
    """What differs between two checkpoints' hashes, one line per file or tensor.

    Args:
        recorded: ``checkpoint_hashes`` of the baseline.
        now: ``checkpoint_hashes`` of the rerun.

    Returns:
        Lines such as ``tensor model.layers.0.mlp.down_proj.weight_packed differs``;
        empty when every byte that matters is the same.
    """
    found = []
    for kind in ("files", "tensors"):
        old, new = recorded.get(kind, {}), now.get(kind, {})
        for name in sorted(old.keys() | new.keys()):
            if name not in new:
                found.append(f"{kind[:-1]} {name} missing now")
            elif name not in old:
                found.append(f"{kind[:-1]} {name} new (not in the record)")
            elif old[name] != new[name]:
                found.append(f"{kind[:-1]} {name} differs")
    return found


def calibration_file(dataset: str) -> Path:
    """The file a ``--dataset`` value reads: a path under the repository root, or the embedded text."""
    if dataset == "default":
        return ROOT / "src" / "seqcal" / "assets" / "calibration.txt"
    return (ROOT / dataset).resolve()


def record(path: Path, names: list[str], settings: Settings, work: Path) -> None:
    """Run every recipe of ``names`` and write each one's hashes to ``path`` as soon as it is done.

    A record already at ``path`` made with the same settings, data, code and environment keeps its other
    recipes (so recipes can be recorded by separate processes); any other record is replaced.

    Args:
        path: the JSON to write.
        names: keys of ``RECIPES``.
        settings: calibration size, threads and data.
        work: folder of the checkpoints.
    """
    data = calibration_file(settings.dataset)
    header = {"settings": asdict(settings), "dataset_sha256": sha256(data.read_bytes()), "commit": source_commit(),
              "environment": environment(settings), "skipped_files": SKIPPED}  # fmt: skip
    for name in names:
        line, hashes, seconds = run_recipe(name, settings, work)
        _merge(path, header, name, {"command": line, "seconds": round(seconds, 1), **hashes})
        print(
            f"{name}: {len(hashes['files'])} files, {len(hashes['tensors'])} tensors, {seconds:.1f} s -> {path}"
        )


def _merge(path: Path, header: dict, name: str, entry: dict) -> None:
    with open(path, "a+", encoding="utf-8") as file:
        fcntl.flock(file, fcntl.LOCK_EX)  # another process recording other recipes may write at the same time
        file.seek(0)
        text = file.read()
        old = json.loads(text) if text.strip() else {}
        same = all(old.get(key) == value for key, value in header.items())
        result = {**header, "recipes": {**(old.get("recipes", {}) if same else {}), name: entry}}
        file.seek(0)
        file.truncate()
        file.write(json.dumps(result, indent=1, sort_keys=True) + "\n")


def check(path: Path, names: list[str] | None, work: Path) -> int:
    """Rerun the recorded command lines and compare with ``path``.

    Args:
        path: the recorded JSON.
        names: recipes to check (None: every recorded one).
        work: folder of the checkpoints.

    Returns:
        The exit status: 0 when every checked checkpoint is the same, 1 otherwise.
    """
    baseline = json.loads(path.read_text(encoding="utf-8"))
    missing = sorted(set(names or []) - set(baseline["recipes"]))
    if missing:
        raise SystemExit(f"checkpoint_hashes: {path} holds no record of {', '.join(missing)}; record it first "
                         f"(--recipes {' '.join(missing)} without --check) or check {', '.join(baseline['recipes'])}")  # fmt: skip
    settings = Settings(**baseline["settings"])
    data = calibration_file(settings.dataset)
    if not data.is_file() or sha256(data.read_bytes()) != baseline["dataset_sha256"]:
        raise SystemExit(f"checkpoint_hashes: the calibration data {data} is missing or not the recorded one; "
                         "run where the record was made, or record a new baseline first")  # fmt: skip
    env = environment(settings)
    print(f"checking {source_commit()} against the record of {baseline['commit']}")
    for key, value in baseline["environment"].items():
        if env.get(key) != value:
            print(
                f"warning: {key} is {env.get(key)!r}, the record has {value!r}: the bytes may differ for that"
            )
    status = 0
    for name in names or list(baseline["recipes"]):
        line, hashes, seconds = run_recipe(name, settings, work)
        wanted = baseline["recipes"][name]
        if line != wanted["command"]:
            print(f"warning: {name}: command line now\n  {line}\nrecorded\n  {wanted['command']}")
        found = differences(wanted, hashes)
        verdict = "same" if not found else f"different ({len(found)} entries)"
        print(
            f"{name}: {verdict} ({len(hashes['files'])} files, {len(hashes['tensors'])} tensors, {seconds:.1f} s)"
        )
        for entry in found:
            print(f"  {entry}")
        status = status or int(bool(found))
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="rerun the recorded commands and compare")
    parser.add_argument("--json", type=Path, default=RECORD, help=f"the record (default {RECORD.name})")
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), help="only these (default: all)")
    parser.add_argument("--work-dir", type=Path, default=WORK, help="where the checkpoints are written")
    defaults = Settings()
    parser.add_argument("--samples", type=int, default=defaults.samples, help="record only")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help="record only")
    parser.add_argument("--threads", type=int, default=defaults.threads, help="record only")
    args = parser.parse_args(argv)
    work = args.work_dir.resolve()
    if args.check:
        return check(args.json, args.recipes, work)
    dataset = WIKITEXT if calibration_file(WIKITEXT).is_file() else "default"
    settings = Settings(samples=args.samples, seq_len=args.seq_len, threads=args.threads, dataset=dataset)
    record(args.json, args.recipes or list(RECIPES), settings, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
