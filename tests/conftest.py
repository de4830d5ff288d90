"""Shared fixtures: the embedded default model, WikiText-2 text, and a fixed seed."""

from __future__ import annotations

import os

# Before anything imports huggingface_hub: tests never reach the Hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from seqcal.models import EmbeddedModelMissingError, default_model_dir  # noqa: E402

# shared/ sits next to the repository (the repo's parent holds it, in CI as in development).
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Directory of the converted SmolLM2-135M-Instruct checkpoint (converted once, then cached)."""
    try:
        return default_model_dir()
    except EmbeddedModelMissingError as err:
        pytest.skip(f"embedded default model unavailable: {err}")


@pytest.fixture(scope="session")
def tokenized_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A 2-layer random Llama saved with SmolLM2's tokenizer, for tests that run the CLI on text."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # layers must hold >= 10% of the parameters to be found as targets, next to a 49152-token embedding
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


def _read_shared(name: str) -> str:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"{path} is absent; the WikiText-2 files come with shared/ next to the repository")
    # Text mode: the test split has CRLF line ends, read as "\n" like the validation split.
    return path.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def wiki_test_text() -> str:
    """WikiText-2 raw test split: evaluation (perplexity) text."""
    return _read_shared("wiki.test.raw")


@pytest.fixture(scope="session")
def wiki_valid_text() -> str:
    """WikiText-2 raw validation split: calibration text, disjoint from the test split."""
    return _read_shared("wiki.valid.raw")
