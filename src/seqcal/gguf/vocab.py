"""The tokenizer as GGUF metadata: tokens, their types, merges, special ids and the chat template.

Byte-level BPE tokenizers (GPT-2 style: SmolLM, Llama 3, Qwen) are written as llama.cpp's ``gpt2`` model with
their merges. llama.cpp splits text before BPE by a pre-tokenizer it names (``tokenizer.ggml.pre``); it is
recognised here from the tokenizer's own pre-tokenizer (tokenizer.json), since a wrong one tokenizes digits and
punctuation differently without any error. SentencePiece-style tokenizers (byte fallback: Mistral, Llama 2)
are written as llama.cpp's ``llama`` model through gguf-py's ``LlamaHfVocab``, with whether a space is put
before the text (``add_space_prefix``: Llama 2 and Mistral do, Gemma does not). Special token ids, whether BOS
is added, and the chat template come from gguf-py's ``SpecialVocab``, which reads the saved tokenizer files.

Example:
    >>> add_tokenizer(writer, tokenizer, config)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import gguf

# Pre-tokenizers of tokenizer.json -> llama.cpp's name for the same split. The regexes are the tokenizers' own.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip


class GGUFTokenizerError(ValueError):
    """A tokenizer the GGUF writer cannot describe to llama.cpp faithfully."""


def bpe_pre(tokenizer_json: dict) -> str:
    """llama.cpp's pre-tokenizer name for a byte-level BPE tokenizer.json.

    Raises:
        GGUFTokenizerError: a pre-tokenizer llama.cpp's names do not cover here.
    """
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if (
        kinds == ["Digits", "ByteLevel"]
        and steps[0].get("individual_digits")
        and steps[1].get("use_regex", True)
    ):
        return "smollm"  # llama.cpp splits digits one by one, then the GPT-2 regex (as starcoder)
    if kinds and kinds[0] == "Split":
        pattern = steps[0].get("pattern", {}).get("Regex")
        if pattern == _LLAMA3_SPLIT:
            return "llama-bpe"
        if pattern == _QWEN2_SPLIT:
            return "qwen2"
    raise GGUFTokenizerError(
        f"output_format='gguf': the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds)) or 'none'}) is not one "
        "llama.cpp's names cover here (GPT-2, SmolLM, Llama 3, Qwen2); save a compressed-tensors checkpoint instead"
    )


def space_prefix(tokenizer_json: dict) -> bool:
    """Whether a SentencePiece-style tokenizer.json puts "▁" before the text: a ``Prepend`` normalizer (Llama 2,
    Mistral) or a ``Metaspace`` pre-tokenizer that prepends; Gemma's replace spaces only."""

    def steps(part: dict | None, key: str) -> list[dict]:
        part = part or {}
        return part.get(key, []) if part.get("type") == "Sequence" else [part]

    if any(n.get("type") == "Prepend" for n in steps(tokenizer_json.get("normalizer"), "normalizers")):
        return True
    return any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") in ("always", "first")
               for p in steps(tokenizer_json.get("pre_tokenizer"), "pretokenizers"))  # fmt: skip


def check_tokenizer(tokenizer: Any) -> None:
    """Refuse, before calibration, a tokenizer :func:`add_tokenizer` could not write."""
    with tempfile.TemporaryDirectory() as tmp:
        _kind(_saved(tokenizer, Path(tmp)))


def _saved(tokenizer: Any, folder: Path) -> dict:
    if tokenizer is None:
        raise GGUFTokenizerError("output_format='gguf' needs the model's tokenizer (pass tokenizer=...)")
    tokenizer.save_pretrained(str(folder))
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise GGUFTokenizerError("output_format='gguf' needs a fast tokenizer (tokenizer.json); load it with "
                                 "use_fast=True")  # fmt: skip
    return json.loads(path.read_text(encoding="utf-8"))


def _kind(tokenizer_json: dict) -> str:
    """The llama.cpp tokenizer model: "gpt2" (byte-level BPE) or "llama" (BPE with byte fallback)."""
    model = tokenizer_json.get("model", {})
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return "llama"
    if model.get("type") == "BPE" and (tokenizer_json.get("decoder") or {}).get("type") == "ByteLevel":
        bpe_pre(tokenizer_json)
        return "gpt2"
    raise GGUFTokenizerError(f"output_format='gguf': a {model.get('type')} tokenizer is not written yet (byte-level "
                             "BPE and byte-fallback BPE are); save a compressed-tensors checkpoint instead")  # fmt: skip


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer: Any, vocab_size: int) -> None:
    """Write the tokenizer keys of ``tokenizer`` (padded with unused tokens to the model's ``vocab_size``)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tokenizer_json = _saved(tokenizer, folder)
        kind = _kind(tokenizer_json)
        if kind == "llama":
            vocab = gguf.LlamaHfVocab(folder)
            tokens, scores, types = zip(*vocab.all_tokens())
            tokens, scores, types = list(tokens), list(scores), list(types)
        else:
            tokens, types = _bpe_tokens(tokenizer)
            scores = None
        for i in range(len(tokens), vocab_size):  # embedding rows past the tokenizer's ids
            tokens.append(f"[PAD{i}]".encode() if kind == "llama" else f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            if scores is not None:
                scores.append(-1000.0)
        writer.add_tokenizer_model(kind)
        writer.add_tokenizer_pre("default" if kind == "llama" else bpe_pre(tokenizer_json))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        if scores is not None:
            writer.add_token_scores(scores)
        if kind == "llama":  # llama.cpp prepends a space unless told not to (Gemma's tokenizers do not)
            writer.add_add_space_prefix(space_prefix(tokenizer_json))
        gguf.SpecialVocab(folder, load_merges=kind == "gpt2", n_vocab=len(tokens)).add_to_gguf(
            writer, quiet=True
        )


def _bpe_tokens(tokenizer: Any) -> tuple[list[str], list[int]]:
    """Tokens by id, typed as llama.cpp's converter types them: special added tokens CONTROL, other added
    tokens USER_DEFINED, the rest NORMAL."""
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    tokens, types = [], []
    for i in range(max(by_id) + 1):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(token)
        entry = added.get(i)
        kind = gguf.TokenType.NORMAL
        if entry is not None:
            kind = gguf.TokenType.CONTROL if entry.special else gguf.TokenType.USER_DEFINED
        types.append(kind)
    return tokens, types
