"""Hub ids: models and datasets resolve from a Hugging Face Hub cache, as transformers and datasets do.

The tests build the cache themselves (``models--org--tiny/{refs,snapshots}`` and ``datasets--org--calib``),
so they run offline; HF_HUB_OFFLINE=1 stays set, as conftest sets it. End-to-end runs go through a subprocess
whose environment points huggingface_hub at that cache, exactly as a user's shell would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from seqcal.data.batches import DataArgs, load_calibration_batches
from seqcal.entrypoint import ModelArgs, load_model
from seqcal.models import resolve_model

TEXTS = [
    "The river carried silt from the mountains down to the wide green delta every spring.",
    "Glaciers carve valleys slowly, grinding rock into fine powder over thousands of years.",
    "Early printing presses spread pamphlets and books across Europe within a few decades.",
    "A compiler translates source code into machine instructions in several separate stages.",
    "Suspension bridges hang their decks from steel cables slung between two tall towers.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen in leaves.",
]
MAIN, V2 = "1" * 40, "2" * 40
RECIPE = "GPTQModifier: {scheme: W4A16, ignore: [lm_head]}\n"


def _tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(TEXTS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _snapshot(repo: Path, sha: str, ref: str) -> Path:
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(sha)
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    return snap


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hub cache holding model org/tiny (main, and a tag v2 with other weights) and dataset org/calib."""
    root = tmp_path_factory.mktemp("hub")
    tok = _tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    for sha, ref, seed in ((MAIN, "main", 0), (V2, "v2", 1)):
        torch.manual_seed(seed)
        snap = _snapshot(root / "models--org--tiny", sha, ref)
        LlamaForCausalLM(config).save_pretrained(snap)
        tok.save_pretrained(snap)
    snap = _snapshot(root / "models--org--binonly", MAIN, "main")
    config.save_pretrained(snap)
    (snap / "pytorch_model.bin").write_bytes(b"")
    data = _snapshot(root / "datasets--org--calib", MAIN, "main") / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return root


@pytest.fixture
def in_cache(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point this process's huggingface_hub (read at import, so patched) and datasets caches at the test's."""
    import datasets
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE, "conftest sets HF_HUB_OFFLINE=1 before huggingface_hub is imported"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    return cache


def _env(cache: Path, tmp_path: Path) -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home"),
            "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
            "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}  # fmt: skip


def _seqcal(args: list[str], cache: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "seqcal.cli", *args], env=_env(cache, tmp_path),
                          capture_output=True, text=True, timeout=600)  # fmt: skip


# ---- models ---------------------------------------------------------------------------------------------------


def test_hub_id_resolves_to_its_cached_snapshot_and_revision(in_cache: Path) -> None:
    assert resolve_model("org/tiny") == in_cache / "models--org--tiny" / "snapshots" / MAIN
    assert resolve_model("org/tiny", revision="v2") == in_cache / "models--org--tiny" / "snapshots" / V2
    assert resolve_model("org/tiny", revision=V2).name == V2


def test_hub_id_not_cached_offline_is_one_sentence_with_the_fix(in_cache: Path) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model("org/missing")
    message = str(info.value)
    assert "'org/missing' is neither an alias nor an existing directory" in message
    assert "not in the Hugging Face Hub cache" in message and str(in_cache) in message
    assert "while HF_HUB_OFFLINE=1; run once online" in message and "pass a local path" in message
    with pytest.raises(
        ValueError,
        match=r"as a Hub id it is not in the Hugging Face Hub cache \(.*\) at revision 'nope' while",
    ):
        resolve_model("org/tiny", revision="nope")


def test_hub_model_without_safetensors_is_refused(in_cache: Path) -> None:
    with pytest.raises(ValueError, match=r"'org/binonly' has no \.safetensors weights.*save_pretrained"):
        resolve_model("org/binonly")


def test_a_local_directory_wins_over_a_hub_id(in_cache: Path, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny") == Path("org/tiny")


def test_only_config_tokenizer_and_safetensors_are_downloaded(monkeypatch, tmp_path: Path) -> None:
    """Online, snapshot_download gets patterns that fetch no pickled weights; remote code only when trusted."""
    import huggingface_hub

    calls = []

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        snap = tmp_path / repo_id.replace("/", "--")
        snap.mkdir(exist_ok=True)
        (snap / "config.json").write_text("{}")
        (snap / "model.safetensors").write_bytes(b"")
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    resolve_model("org/online", revision="r1")
    resolve_model("org/remote", trust_remote_code=True)
    (_, plain), (_, remote) = calls
    assert plain["revision"] == "r1" and plain["repo_type"] == "model"
    patterns = plain["allow_patterns"]
    for name in ("config.json", "tokenizer.json", "tokenizer.model", "merges.txt", "model.safetensors",
                 "model.safetensors.index.json", "chat_template.jinja"):  # fmt: skip
        assert any(Path(name).match(p) for p in patterns), name
    for name in ("pytorch_model.bin", "model.pt", "modeling_x.py"):
        assert not any(Path(name).match(p) for p in patterns), name
    assert "*.py" in remote["allow_patterns"]


def _hub_error(name: str) -> Exception:
    """A huggingface_hub error as snapshot_download raises it online (built without an HTTP response)."""
    import huggingface_hub.errors

    cls = getattr(huggingface_hub.errors, name)
    err = cls.__new__(cls)
    Exception.__init__(err, "from the Hub")
    return err


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            "GatedRepoError",
            r"is gated on the Hugging Face Hub: accept its terms at https://huggingface.co/org/x ",
        ),
        (
            "RepositoryNotFoundError",
            r"is not a repository on the Hugging Face Hub .*check the name or pass a local",
        ),
        ("RevisionNotFoundError", r"has no revision 'r9' on the Hugging Face Hub; pass an existing branch"),
    ],
)
def test_online_hub_errors_say_what_to_do(error: str, expected: str, monkeypatch) -> None:
    import huggingface_hub

    def fail(repo_id, **kwargs):
        raise _hub_error(error)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(ValueError, match=r"^seqcal.models.resolve_model: 'org/x' is neither an alias nor an "
                                         r"existing directory, and as a Hub id it " + expected):  # fmt: skip
        resolve_model("org/x", revision="r9")


def test_offloaded_loading_reads_the_hub_snapshot(in_cache: Path) -> None:
    """The memory-bounded path: a Hub id is a directory whose safetensors are read one subgraph at a time."""
    model, tok, store = load_model(ModelArgs("org/tiny"), offload_weights=True)
    assert store is not None
    assert all(p.device.type == "meta" for p in model.parameters())
    assert tok is not None and tok.eos_token == "<eos>"
    eager, _, _ = load_model(ModelArgs("org/tiny", revision="v2", tokenizer="org/tiny"))
    reference = LlamaForCausalLM.from_pretrained(in_cache / "models--org--tiny" / "snapshots" / V2)
    assert torch.equal(eager.lm_head.weight, reference.lm_head.weight)


# ---- datasets -------------------------------------------------------------------------------------------------


def test_hub_dataset_loads_from_the_hub_cache_offline(in_cache: Path) -> None:
    tok = _tokenizer()
    args = DataArgs(
        "org/calib", num_calibration_samples=4, shuffle_calibration_samples=False, splits="train[:4]"
    )
    batches = load_calibration_batches(args, tok)
    first = batches[0]["input_ids"][0]
    assert tok.decode(first[first != tok.pad_token_id]) == TEXTS[0]
    assert sum(len(b["input_ids"]) for b in batches) == 4


def test_hub_dataset_not_cached_offline_names_the_fix(in_cache: Path) -> None:
    with pytest.raises(ConnectionError, match=r"'org/nodata': offline .*not in the Hugging Face Hub cache.*"
                                              r"run once online.*Pass a local file instead"):  # fmt: skip
        load_calibration_batches(DataArgs("org/nodata"), _tokenizer())


# ---- end to end, with HF_HUB_OFFLINE=1 read by huggingface_hub from the environment ----------------------------


def test_oneshot_cli_on_cached_hub_model_and_dataset(cache: Path, tmp_path: Path) -> None:
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    out = tmp_path / "out"
    done = _seqcal(["oneshot", "--model", "org/tiny", "--dataset", "org/calib", "--recipe", str(tmp_path / "recipe.yaml"),
                    "--output-dir", str(out), "--num-calibration-samples", "4", "--max-seq-length", "32"],
                   cache, tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert (out / "tokenizer.json").is_file()


def test_python_oneshot_honours_hf_hub_offline_from_the_environment(cache: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "o")
    script = "\n".join([
        "from seqcal import oneshot",
        f"oneshot(model='org/tiny', dataset='org/calib', recipe={RECIPE!r}, output_dir={out!r},",
        "        num_calibration_samples=4, max_seq_length=32)",
        f"oneshot(model='org/absent', recipe={RECIPE!r})",
    ])  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], env=_env(cache, tmp_path), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert (tmp_path / "o" / "model.safetensors").is_file(), done.stderr[-3000:]
    assert "'org/absent' is neither an alias nor an existing directory" in done.stderr
    assert "while HF_HUB_OFFLINE=1" in done.stderr


def test_trace_and_eval_cli_resolve_hub_ids(cache: Path, tmp_path: Path) -> None:
    done = _seqcal(["trace", "--model", "org/tiny"], cache, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "traced in" in done.stdout
    text = tmp_path / "eval.txt"
    text.write_text("\n\n".join(TEXTS * 20))
    eval_args = ["--dataset", str(text), "--eval-seq-length", "32", "--eval-windows", "2"]
    done = _seqcal(["eval", "ppl", "--model", "org/tiny", *eval_args], cache, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.rsplit(":", 1)[1]) > 1.0  # a perplexity, computed with the snapshot's model
    done = _seqcal(["eval", "ppl", "--model", "org/missing", *eval_args], cache, tmp_path)
    assert done.returncode != 0
    assert "'org/missing' is neither an alias nor an existing directory" in done.stderr
    assert "HF_HUB_OFFLINE=1" in done.stderr
