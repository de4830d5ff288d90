"""Model-free quantization: the bytes of oneshot's datafree checkpoint, for every scheme, from any number of
workers, after a kill and a resume; targets and ignore as in recipes; the NVFP4 global scale shared by the
modules vLLM fuses; bad input refused in one sentence before anything is written.

The kill runs model-free in a child process whose wrapper replaces the shard file's ``finish`` by one that
SIGKILLs the process when the second file is about to be completed (the product code has no hook).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from seqcal import model_free_ptq, oneshot
from seqcal.algorithms.formats import global_scale_of
from seqcal.checkpoint.streaming import ResumeError
from seqcal.cli import main as cli_main
from seqcal.modelfree.memory import WORKER_BASE, HostMemoryError, workers_for
from seqcal.modelfree.source import SourceError
from seqcal.sources import SourceFormatError

SCHEMES = ["W4A16", "W8A16", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16"]
KILL = """
import os, signal, sys
import seqcal.checkpoint.shard_file as shard_file
from seqcal import model_free_ptq
finish, calls = shard_file._ShardFile.finish, []
def finish_then_die(self, metadata):
    calls.append(1)
    if len(calls) == 2:  # the second file is written but not complete: killed before its header
        os.kill(os.getpid(), signal.SIGKILL)
    finish(self, metadata)
shard_file._ShardFile.finish = finish_then_die
model_free_ptq(sys.argv[1], sys.argv[2], scheme="W4A16", ignore=["lm_head"])
"""


def _llama(path: Path, shard: str | None = None) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(
        path, **({"max_shard_size": shard} if shard else {})
    )
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model in files of about 100 KB: q, k and v of a layer land in different files."""
    path = _llama(tmp_path_factory.mktemp("sharded"), "100KB")
    assert len(list(path.glob("*.safetensors"))) > 3
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                            num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, head_dim=32, max_position_embeddings=64)  # fmt: skip
    path = tmp_path_factory.mktemp("moe")
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _oneshot(model: Path, out: Path, scheme: str, extra: str = "ignore: [lm_head]") -> Path:
    oneshot(model=str(model), recipe=f"QuantizationModifier: {{scheme: {scheme}, {extra}}}", pipeline="datafree",
            output_dir=str(out))  # fmt: skip
    return out


def _tensors(directory: Path) -> dict[str, bytes]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                t = f.get_tensor(key)
                out[key] = (
                    t.reshape(-1).view(torch.uint8).numpy().tobytes() + str((t.dtype, t.shape)).encode()
                )
    return out


def _checkpoint_files(directory: Path) -> list[str]:
    """The weights, the index and config.json (not oneshot's report and recipe)."""
    return sorted(
        p.name
        for p in directory.iterdir()
        if p.suffix == ".safetensors" or p.name.startswith(("config", "model"))
    )


def _same_files(a: Path, b: Path) -> None:
    names = _checkpoint_files(a)
    assert names == _checkpoint_files(b)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("scheme", SCHEMES)
def test_llama_bytes_equal_oneshot_datafree(llama: Path, tmp_path: Path, scheme: str) -> None:
    ref = _oneshot(llama, tmp_path / "oneshot", scheme)
    out = model_free_ptq(llama, tmp_path / "mf", scheme=scheme, ignore=["lm_head"])
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name


@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16"])
def test_moe_bytes_equal_oneshot_datafree(moe: Path, tmp_path: Path, scheme: str) -> None:
    ref = _oneshot(moe, tmp_path / "oneshot", scheme)
    out = model_free_ptq(moe, tmp_path / "mf", scheme=scheme, ignore=["lm_head"])
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    ignored = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.mlp.gate" in ignored  # the router: vLLM builds it as a Linear


def test_targets_and_ignore_resolve_as_in_recipes(llama: Path, tmp_path: Path) -> None:
    extra = "targets: ['re:.*mlp.*'], ignore: ['re:.*down_proj']"
    ref = _oneshot(llama, tmp_path / "oneshot", "W8A16", extra)
    out = model_free_ptq(
        llama, tmp_path / "mf", scheme="W8A16", targets=["re:.*mlp.*"], ignore=["re:.*down_proj"]
    )
    _same_files(out, ref)
    keys = _tensors(out)
    assert "model.layers.1.mlp.up_proj.weight_scale" in keys and "model.layers.1.mlp.down_proj.weight" in keys
    assert "model.layers.1.self_attn.q_proj.weight" in keys  # not targeted: as it was


def test_config_with_several_groups_as_in_recipes(llama: Path, tmp_path: Path) -> None:
    """llm-compressor's ``config`` (a QuantizationConfig's dict): each group as a recipe's config group."""
    groups = {
        "group_0": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                            "strategy": "channel"}},
        "group_1": {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                                  "strategy": "group", "group_size": 64}},
    }  # fmt: skip
    ref = tmp_path / "oneshot"
    recipe = "QuantizationModifier: " + json.dumps({"config_groups": groups, "ignore": ["lm_head"]})
    oneshot(model=str(llama), recipe=recipe, pipeline="datafree", output_dir=str(ref))
    out = model_free_ptq(llama, tmp_path / "mf", config={"config_groups": groups, "ignore": ["lm_head"]})
    _same_files(out, ref)
    assert len(json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]) == 2


def test_unknown_architecture_reads_modules_from_names(moe: Path, tmp_path: Path) -> None:
    """An architecture transformers does not have: the same tensors and quantization_config as oneshot's."""
    source = tmp_path / "mystery"
    source.mkdir()
    for file in moe.iterdir():
        (source / file.name).write_bytes(file.read_bytes())
    config = json.loads((moe / "config.json").read_text())
    (source / "config.json").write_text(
        json.dumps({**config, "model_type": "mystery_moe", "architectures": ["X"]})
    )
    ref = _oneshot(moe, tmp_path / "oneshot", "NVFP4A16")
    out = model_free_ptq(source, tmp_path / "mf", scheme="NVFP4A16", ignore=["lm_head"])
    assert _tensors(out) == _tensors(ref)
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    expected = json.loads((ref / "config.json").read_text())["quantization_config"]
    # the ignore list in module order, which only the model's classes know: the same entries
    assert sorted(block.pop("ignore")) == sorted(expected.pop("ignore"))
    assert block == expected
    assert json.loads((out / "config.json").read_text())["model_type"] == "mystery_moe"


def test_stacked_experts_of_an_unknown_architecture_are_refused(tmp_path: Path) -> None:
    source = tmp_path / "stacked"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "mystery_moe", "architectures": ["X"]}))
    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.randn(128, 128, dtype=torch.bfloat16),
               "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 256, 128, dtype=torch.bfloat16),
               "model.layers.0.mlp.experts.down_proj": torch.randn(4, 128, 128, dtype=torch.bfloat16)}  # fmt: skip
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SourceError, match=r"4 experts' weights stacked .* add 're:model\\.layers\\.0"):
        model_free_ptq(source, tmp_path / "refused", scheme="W4A16")
    out = model_free_ptq(source, tmp_path / "mf", scheme="W4A16", ignore=["re:.*experts$"])
    keys = _tensors(out)
    assert (
        "model.layers.0.self_attn.q_proj.weight_packed" in keys
        and "model.layers.0.mlp.experts.down_proj" in keys
    )


def test_workers_and_shards_give_the_same_bytes(llama: Path, sharded: Path, tmp_path: Path) -> None:
    one = model_free_ptq(sharded, tmp_path / "one", scheme="NVFP4A16", ignore=["lm_head"])
    two = model_free_ptq(sharded, tmp_path / "two", scheme="NVFP4A16", ignore=["lm_head"], max_workers=2)
    _same_files(one, two)
    assert sorted(p.name for p in one.glob("*.safetensors")) == sorted(
        p.name for p in sharded.glob("*.safetensors")
    )
    # the tensors of the one-file model, file boundaries aside
    assert _tensors(one) == _tensors(
        model_free_ptq(llama, tmp_path / "single", scheme="NVFP4A16", ignore=["lm_head"])
    )


def test_fused_modules_share_the_nvfp4_global_scale(sharded: Path, tmp_path: Path) -> None:
    out = model_free_ptq(sharded, tmp_path / "mf", scheme="NVFP4A16", ignore=["lm_head"])
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = "model.layers.1.self_attn."
    assert len({index[f"{prefix}{p}_proj.weight"] for p in "qkv"}) > 1  # q, k and v in different files
    stored = _tensors(out)
    for group in (["q", "k", "v"], ["gate", "up"]):
        parent = "model.layers.1." + ("self_attn." if len(group) == 3 else "mlp.")
        scales = {stored[f"{parent}{p}_proj.weight_global_scale"] for p in group}
        assert len(scales) == 1, group
        smallest = min(
            global_scale_of(safe_open(str(sharded / index[k]), "pt").get_tensor(k))
            for k in (f"{parent}{p}_proj.weight" for p in group)
        )
        assert scales.pop()[:4] == smallest.reshape(1).numpy().tobytes()


def test_resume_after_a_kill_gives_the_same_bytes(sharded: Path, tmp_path: Path) -> None:
    clean = model_free_ptq(sharded, tmp_path / "clean", scheme="W4A16", ignore=["lm_head"])
    killed = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", KILL, str(sharded), str(killed)], env=env, capture_output=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert len(list(killed.glob("*.safetensors"))) == 1 and len(list(killed.glob("*.partial"))) == 1
    assert not (killed / "config.json").exists()
    with pytest.raises(FileExistsError, match="interrupted run"):
        model_free_ptq(sharded, killed, scheme="W4A16", ignore=["lm_head"])
    with pytest.raises(ResumeError, match="quantization_config differs"):
        model_free_ptq(sharded, killed, scheme="W8A16", ignore=["lm_head"], resume=True)
    model_free_ptq(sharded, killed, scheme="W4A16", ignore=["lm_head"], resume=True)
    _same_files(killed, clean)
    assert not list(killed.glob("*.partial")) and not (killed / "seqcal_progress.json").exists()


@pytest.fixture(scope="module")
def fp8_block(tmp_path_factory: pytest.TempPathFactory, llama: Path) -> Path:
    """The Llama stored as DeepSeek ships its weights: FP8 in 128 x 128 blocks with float32 scales."""
    sys.path.insert(0, str(Path(__file__).parent))
    from sources_helpers import write_fp8_block

    return write_fp8_block(llama, tmp_path_factory.mktemp("fp8") / "model", shards=1)


@pytest.mark.parametrize("scheme", ["NVFP4A16", "W4A16"])
def test_fp8_block_source_bytes_equal_oneshot(fp8_block: Path, tmp_path: Path, scheme: str) -> None:
    ref = _oneshot(fp8_block, tmp_path / "oneshot", scheme)
    out = model_free_ptq(fp8_block, tmp_path / "mf", scheme=scheme, ignore=["lm_head"])
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert not any(k.endswith("weight_scale_inv") for k in _tensors(out))
    assert (
        json.loads((out / "config.json").read_text())["quantization_config"]["source_format"]["format"]
        == "fp8-block"
    )


def test_fp8_source_to_8_bits_needs_requantize(fp8_block: Path, tmp_path: Path) -> None:
    with pytest.raises(SourceFormatError, match="requantize=True"):
        model_free_ptq(fp8_block, tmp_path / "mf", scheme="W8A16", ignore=["lm_head"])
    assert not (tmp_path / "mf").exists()
    out = model_free_ptq(fp8_block, tmp_path / "mf", scheme="W8A16", ignore=["lm_head"], requantize=True)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["source_format"][
        "requantized"
    ]


def test_bad_input_is_refused_before_anything_is_written(llama: Path, sharded: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="unknown scheme 'W5A3'"):
        model_free_ptq(llama, out, scheme="W5A3")
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in sharded.iterdir():
        if not file.name.startswith("model-00002"):
            (broken / file.name).write_bytes(file.read_bytes())
    with pytest.raises(
        SourceError, match="model-free: .*names shard 'model-00002-of-.*download the missing shards"
    ):
        model_free_ptq(broken, out, scheme="W4A16")
    assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        model_free_ptq(llama, out, scheme="W4A16")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match="static scales, which need calibration data"):
        model_free_ptq(llama, tmp_path / "fp8", scheme="FP8")


def test_cli_errors_are_one_line(llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        cli_main(
            ["model-free", "--model", str(llama), "--output-dir", str(tmp_path / "o"), "--scheme", "W5A3"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("seqcal: error:") and "unknown scheme" in err and len(err.splitlines()) == 1
    args = ["model-free", "--model", str(llama), "--output-dir", str(tmp_path / "cli"), "--scheme", "W4A16",
            "--ignore", "lm_head", "-q"]  # fmt: skip
    assert cli_main(args) == 0
    assert (tmp_path / "cli" / "config.json").is_file()


def test_host_budget_sets_the_workers_or_refuses() -> None:
    peak = WORKER_BASE + (1 << 30)
    assert workers_for(None, 4, [peak], 1 << 30) == 4
    assert workers_for((1 << 30) + WORKER_BASE + 3 * peak, 8, [peak], 1 << 30) == 3
    with pytest.raises(HostMemoryError, match=r"largest weight needs \(2.00 GiB with one process\)"):
        workers_for(1 << 30, 2, [peak], 1 << 30)


@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16"])
def test_float32_file_under_a_bfloat16_config_is_quantized_as_oneshot_does(tmp_path: Path, scheme: str) -> None:
    """oneshot reads a float32 file into the bfloat16 model its config names and rounds those weights; model-free
    casts each weight (and its fused partners) the same way first, and writes the other tensors in bfloat16 too."""
    source = tmp_path / "fp32"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(source)  # float32 tensors
    data = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**data, "dtype": "bfloat16"}))
    ref = _oneshot(source, tmp_path / "oneshot", scheme)
    out = model_free_ptq(source, tmp_path / "mf", scheme=scheme, ignore=["lm_head"])
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
