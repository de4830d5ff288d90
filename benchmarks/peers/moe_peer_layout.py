"""seqcal's MoE checkpoint layout against llm-compressor 0.14's, side by side, architecture by architecture.

For every mixture-of-experts architecture that both seqcal's transformers (``.venv``) and llm-compressor's
(``.peer-venv``, made by ``benchmarks/setup_peer.sh``) build experts for with ``use_experts_implementation``
(the zoo's hand-written MoE entries, plus every other such text model ``tests/autozoo.py`` builds from a
tiny config), with random weights:

1. build the tiny model with seqcal's transformers and ``save_pretrained`` it once (per-expert checkpoint
   tensors wherever transformers splits its fused experts on save); llm-compressor's transformers loads
   that directory, and its missing / unexpected keys are reported;
2. quantize it with seqcal (``oneshot`` on the directory) and with llm-compressor (``llmcompressor.oneshot``
   in the peer venv, ``benchmarks/peers/_peer_moe.py``), the same recipe (GPTQ, 4-bit symmetric int weights in
   groups of 8 -- W4A16 with a group the tiny widths divide --, ``targets: [Linear]``, ignoring ``lm_head``
   and the routers as llm-compressor's MoE examples do) and the same calibration samples;
3. compare the two checkpoints' safetensors headers tensor by tensor (names, shapes, dtypes) and the
   ``quantization_config`` of their ``config.json`` (format, config groups, ignore list), count the
   quantized expert tensors against experts x projections x MoE layers, and measure the largest relative
   error of a dequantized expert weight against the original, for both tools.

Usage:
    PYTHONPATH=src .venv/bin/python benchmarks/peers/moe_peer_layout.py [--archs mixtral gpt_oss ...] [--zoo-only]
        [--json rows.json]
    .venv/bin/python benchmarks/peers/moe_peer_layout.py --from-json a.json b.json   # re-render (merged) only
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
PEER_PY = Path(os.environ.get("PEER_VENV", REPO / ".peer-venv")) / "bin" / "python"
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]

from seqcal.algorithms import dequantize, unpack_int32  # noqa: E402
from seqcal.entrypoint import oneshot  # noqa: E402
from seqcal.experts import LinearExperts, linearize_experts  # noqa: E402

ZOO_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "gpt_oss", "granitemoe", "jamba",
           "qwen3_next", "lfm2_moe")  # fmt: skip
GROUP = 8
# seqcal refuses an ignore entry that matches no module: each architecture gets those that match one
IGNORE = ("lm_head", "re:.*[.](gate|router)$", "re:.*shared_expert_gate$")
RECIPE = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: {ignore}
      config_groups:
        group_0:
          targets: [Linear]
          weights: {{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: {group}}}
"""


def recipe_for(model: torch.nn.Module) -> str:
    """The recipe, its ignore list cut to the entries that match a module of ``model``."""
    names = [n for n, _ in model.named_modules()]
    ignore = [
        p for p in IGNORE if any(re.fullmatch(p[3:], n) if p.startswith("re:") else n == p for n in names)
    ]
    return RECIPE.format(ignore=json.dumps(ignore), group=GROUP)


SAMPLES, SEQ_LEN = 4, 24
# projection leaf -> role ("wgate": llm-compressor's DeepSeek-V4 gate; "linear_gate": HY-V4's checkpoint name)
ROLES = {"gate_proj": "gate", "w1": "gate", "wgate": "gate", "linear_gate": "gate",
         "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}  # fmt: skip


EXPERT_PACKED = re.compile(r"experts\.\d+\.\w+\.weight_packed$")  # a quantized per-expert projection


def quantized(d: dict) -> int | str:
    """Quantized per-expert tensors of a measured checkpoint, counted on its header."""
    return sum(bool(EXPERT_PACKED.search(k)) for k in d["header"]) if "header" in d else "-"


@dataclass
class Row:
    arch: str
    want: int = 0
    seqcal: dict = field(default_factory=dict)  # header, config, quantized, error or "failed"
    peer: dict = field(default_factory=dict)
    note: str = ""


def header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of a checkpoint directory: name -> (dtype, shape), from the safetensors headers only."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            meta = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in meta.items() if k != "__metadata__"})
    return out


def expert_key(name: str, leaf_roles: dict[str, str]) -> tuple[int, int, str] | None:
    """(layer, expert, role) of a per-expert tensor name, whatever the tool called the projection."""
    m = re.search(r"layers\.(\d+)\..*experts\.(\d+)\.(\w+)\.weight", name)
    if m is None or m.group(3) not in leaf_roles:
        return None
    return int(m.group(1)), int(m.group(2)), leaf_roles[m.group(3)]


def originals(model: torch.nn.Module) -> tuple[dict, dict[str, str], int]:
    """The original expert weights by (layer, expert, role), leaf name -> role, and experts x projections x
    layers, from the model taken apart into per-expert Linears (its fused parameters sliced)."""
    handle = linearize_experts(model)
    roles = dict(ROLES)
    weights = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, LinearExperts):
            continue
        names = module.layout.names
        roles.update(zip(names, ("gate", "up", "down")))
        for e, expert in enumerate(module.experts):
            for leaf, linear in expert.named_children():
                key = expert_key(f"{prefix}.{e}.{leaf}.weight", roles)
                weights[key] = linear.weight.detach().clone()
    return weights, roles, handle.count


def measure(path: Path, reference: dict, roles: dict[str, str]) -> dict:
    """Header, quantization_config, quantized expert count and the worst dequantized expert error."""
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    packed = [k for k in tensors if EXPERT_PACKED.search(k)]
    worst = 0.0
    for key in [k for k in packed if expert_key(k, roles)]:
        name = key.removesuffix(".weight_packed")
        shape = tuple(tensors[f"{name}.weight_shape"].tolist())
        W = dequantize(
            unpack_int32(tensors[key], 4, shape), tensors[f"{name}.weight_scale"], group_size=GROUP
        )
        ref = reference[expert_key(key, roles)]
        worst = max(worst, ((W.float() - ref.float()).norm() / ref.float().norm()).item())
    config = json.loads((path / "config.json").read_text()).get("quantization_config", {})
    return {"header": header(path), "config": config, "quantized": len(packed), "error": worst}


def run_peer(src: Path, out: Path, tokens: Path, recipe: Path) -> tuple[dict, str]:
    """llm-compressor in its own venv: (its result line, the last lines of its output when it failed)."""
    args = [str(PEER_PY), str(REPO / "benchmarks" / "_peer_moe.py"), "--model", str(src), "--tokens",
            str(tokens), "--recipe", str(recipe), "--out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {}, "timed out"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PEER ")]
    if proc.returncode != 0 or not lines:
        tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return {}, tail[0][:160]
    return json.loads(lines[-1][5:]), ""


def builders(zoo_only: bool) -> dict[str, object]:
    """arch -> zero-argument builder: the zoo's MoE entries, then every other text model type whose experts
    both transformers build with ``use_experts_implementation`` (vision-language ones left out)."""
    from zoo import ARCHS

    out: dict[str, object] = {a: ARCHS[a].build for a in ZOO_MOE}
    if zoo_only:
        return out
    import autozoo

    both = decorated(sys.executable) & decorated(str(PEER_PY))
    for model_type, arch in autozoo.candidates().items():
        if model_type in both and model_type not in out and arch.family == "decoder":
            out[model_type] = lambda arch=arch: autozoo.build(arch)
    return out


def decorated(python: str) -> set[str]:
    """Model types whose modeling file of ``python``'s transformers uses ``@use_experts_implementation``."""
    code = "import transformers, os; print(os.path.dirname(transformers.__file__))"
    root = Path(
        subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    )
    return {
        f.parent.name
        for f in (root / "models").glob("*/modeling_*.py")
        if "@use_experts_implementation" in f.read_text()
    }


def run(arch: str, build: object, work: Path, tokens: Path) -> Row:
    row = Row(arch)
    recipe = work / "recipe.yaml"
    try:
        model = build()  # type: ignore[operator]
        model.save_pretrained(work / "src")
        recipe.write_text(recipe_for(model))
        reference, roles, row.want = originals(build())  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - the table says why
        row.note = f"does not build here: {type(exc).__name__}: {str(exc)[:100]}"
        return row
    ids = load_file(tokens)["input_ids"]
    try:
        start = time.perf_counter()
        oneshot(model=str(work / "src"), dataset=[{"input_ids": r.tolist()} for r in ids], recipe=str(recipe),
                output_dir=str(work / "seqcal"), max_seq_length=SEQ_LEN, num_calibration_samples=SAMPLES)  # fmt: skip
        row.seqcal = measure(work / "seqcal", reference, roles) | {"seconds": time.perf_counter() - start}
    except Exception as exc:  # noqa: BLE001
        row.seqcal = {"failed": f"{type(exc).__name__}: {str(exc)[:160]}"}
    result, failure = run_peer(work / "src", work / "peer", tokens, recipe)
    if failure:
        row.peer = {"failed": failure}
    else:
        row.peer = measure(work / "peer", reference, roles) | result
    return row


def _nonnull(d: dict) -> dict:
    return {k: v for k, v in d.items() if v not in (None, {}, [])}


def compare(a: dict, b: dict) -> dict:
    """Differences of two measured checkpoints (seqcal's ``a``, llm-compressor's ``b``)."""
    ha, hb = a["header"], b["header"]
    ca, cb = a["config"], b["config"]
    groups = {}
    for g in sorted(set(ca.get("config_groups", {})) | set(cb.get("config_groups", {}))):
        ga, gb = ca.get("config_groups", {}).get(g, {}), cb.get("config_groups", {}).get(g, {})
        wa, wb = _nonnull(ga.get("weights") or {}), _nonnull(gb.get("weights") or {})
        diff = {k: (wa.get(k), wb.get(k)) for k in set(wa) | set(wb) if wa.get(k) != wb.get(k)}
        if ga.get("targets") != gb.get("targets") or ga.get("format") != gb.get("format"):
            diff["targets/format"] = (
                (ga.get("targets"), ga.get("format")),
                (gb.get("targets"), gb.get("format")),
            )
        if diff:
            groups[g] = diff
    return {
        "only_seqcal": sorted(set(ha) - set(hb)),
        "only_peer": sorted(set(hb) - set(ha)),
        "shape_dtype": sorted(k for k in set(ha) & set(hb) if ha[k] != hb[k]),
        "format": (ca.get("format"), cb.get("format")),
        "groups": groups,
        "ignore_only_seqcal": sorted(set(ca.get("ignore", [])) - set(cb.get("ignore", []))),
        "ignore_only_peer": sorted(set(cb.get("ignore", [])) - set(ca.get("ignore", []))),
    }


def render(rows: list[Row]) -> list[str]:
    """The per-architecture table, then the differences named."""
    head = (f"{'arch':16s} {'want':>4s} {'q seqcal':>8s} {'q peer':>6s} {'tensors':>7s} {'only s':>6s} "
            f"{'only p':>6s} {'shp/dt':>6s} {'format':>6s} {'groups':>6s} {'ignore':>8s} {'err seqcal':>10s} "
            f"{'err peer':>8s}  note")  # fmt: skip
    lines, details = [head], []
    for r in rows:
        s, p = r.seqcal, r.peer
        if not s or not p or "failed" in s or "failed" in p:
            why = r.note or "; ".join(
                f"{t}: {d['failed']}" for t, d in (("seqcal", s), ("peer", p)) if "failed" in d
            )
            q = lambda d: str(quantized(d))  # noqa: E731
            err = lambda d: f"{d['error']:.4f}" if "error" in d else "-"  # noqa: E731
            lines.append(f"{r.arch:16s} {r.want or '-':>4} {q(s):>8s} {q(p):>6s} {'-':>7s} {'-':>6s} {'-':>6s} "
                         f"{'-':>6s} {'-':>6s} {'-':>6s} {'-':>8s} {err(s):>10s} {err(p):>8s}  {why}")  # fmt: skip
            continue
        c = compare(s, p)
        ign = "=" if not (c["ignore_only_seqcal"] or c["ignore_only_peer"]) else (
            f"+{len(c['ignore_only_seqcal'])}/-{len(c['ignore_only_peer'])}")  # fmt: skip
        loads = "; ".join(f"peer load {k}: {len(v)}" for k, v in p.get("load_problems", {}).items())
        lines.append(
            f"{r.arch:16s} {r.want:4d} {quantized(s):8d} {quantized(p):6d} {len(s['header']):7d} "
            f"{len(c['only_seqcal']):6d} {len(c['only_peer']):6d} {len(c['shape_dtype']):6d} "
            f"{'=' if c['format'][0] == c['format'][1] else 'DIFF':>6s} {'=' if not c['groups'] else 'DIFF':>6s} "
            f"{ign:>8s} {s['error']:10.4f} {p['error']:8.4f}  {loads}"
        )  # fmt: skip
        for key in ("only_seqcal", "only_peer", "shape_dtype", "ignore_only_seqcal", "ignore_only_peer"):
            if c[key]:
                details.append(
                    f"{r.arch} {key} ({len(c[key])}): {', '.join(c[key][:4])}{' ...' if len(c[key]) > 4 else ''}"
                )
        if c["groups"]:
            details.append(f"{r.arch} config_groups (seqcal, peer): {c['groups']}")
    return lines + [""] + details


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="*", help="only these (zoo names or model types)")
    parser.add_argument("--zoo-only", action="store_true", help="only the zoo's hand-written MoE entries")
    parser.add_argument("--json", type=Path, help="write every row here as well")
    parser.add_argument("--from-json", type=Path, nargs="+", help="render the rows --json runs wrote (a later "
                        "file's row of an architecture replaces an earlier one), run nothing")  # fmt: skip
    args = parser.parse_args()
    if args.from_json:
        rows_by_arch = {r["arch"]: Row(**r) for f in args.from_json for r in json.loads(f.read_text())}
        print("\n".join(render(list(rows_by_arch.values()))))
        return
    logging.disable(logging.WARNING)
    torch.manual_seed(0)
    table = builders(args.zoo_only)
    names = args.archs or list(table)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "tokens.safetensors"
        g = torch.Generator().manual_seed(3)
        save_file({"input_ids": torch.randint(3, 200, (SAMPLES, SEQ_LEN), generator=g)}, str(tokens))
        for arch in names:
            start = time.perf_counter()
            rows.append(run(arch, table[arch], Path(tmp) / arch, tokens))
            print(f"# {arch}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            if args.json:
                args.json.write_text(json.dumps([_jsonable(r) for r in rows], indent=1))
    print("\n".join(render(rows)))


def _jsonable(row: Row) -> dict:
    return {"arch": row.arch, "want": row.want, "note": row.note, "seqcal": row.seqcal, "peer": row.peer}


if __name__ == "__main__":
    main()
