"""Tokenizers trained offline in a moment, for tests that need real text -> ids without a download."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast


def byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE over ``texts`` (any string encodes) with ids <pad>=0, <eos>=1, <bos>=2.

    Plain text gets a leading <bos>, as Llama-style tokenizers do.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return tok


def word_level(words: Sequence[str], **special: Any) -> PreTrainedTokenizerFast:
    """One token per whitespace-separated word of ``words`` ([UNK] for any other); ``special`` as for
    ``PreTrainedTokenizerFast`` (e.g. ``eos_token="[UNK]"``)."""
    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", **special)


# The GGUF tests' text: short sentences whose words and numbers a 300-token BPE covers.
FOX_TEXTS = [f"the quick brown fox jumps over the lazy dog {i} times, then {i * 7} more" for i in range(40)]


def fox_tokenizer() -> PreTrainedTokenizerFast:
    """A 300-token byte-level BPE of ``FOX_TEXTS`` with <bos>, <eos> and <pad>: what the GGUF writer's tests save."""
    return PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(FOX_TEXTS, 300), bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
