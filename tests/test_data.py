"""Calibration data: every input kind -> deterministic, truncated, correctly padded batches; every error."""

from __future__ import annotations

import csv
import json
import logging
import random
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from seqcal.data.batches import (
    MIN_PARAGRAPH_CHARS,
    CalibrationDataError,
    DataArgs,
    default_calibration_text,
    load_calibration_batches,
)
from tokenizer_helpers import byte_level_bpe

CHAT_TEMPLATE = "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
PARAS = [
    "Rivers carry water and sediment from the hills down to the sea, building wide plains.",
    "The printing press made books cheaper, and more people learned to read and write.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen in leaves.",
    "Suspension bridges hang their decks from steel cables slung between two tall towers.",
    "Folk tales travel across borders, and the same story is told in many distant villages.",
    "A compiler translates source code into machine instructions in several separate stages.",
]


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """A byte-level BPE trained offline on a little text: any string encodes, nothing is downloaded."""
    tok = byte_level_bpe(PARAS + default_calibration_text().split("\n\n")[:10], vocab_size=500)
    return tok.to_str()


def make_tokenizer(padding_side: str = "right", pad: bool = True, eos: bool = True, chat: bool = True):
    specials = (
        {"bos_token": "<bos>"}
        | ({"pad_token": "<pad>"} if pad else {})
        | ({"eos_token": "<eos>"} if eos else {})
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()), **specials)
    tok.padding_side = padding_side
    tok.chat_template = CHAT_TEMPLATE if chat else None
    return tok


@pytest.fixture
def tok():
    return make_tokenizer()


def ids_of(tok, text: str, max_len: int | None = None) -> list[int]:
    ids = tok(text)["input_ids"]
    return ids[:max_len] if max_len else ids


def rows_of(batches) -> list[list[int]]:
    """Unpadded token rows of all batches, in order."""
    return [ids[m.bool()].tolist() for b in batches for ids, m in zip(b["input_ids"], b["attention_mask"])]


def load(dataset, tok, **kw):
    kw.setdefault("shuffle_calibration_samples", False)
    return load_calibration_batches(DataArgs(dataset, **kw), tok)


# ---- the embedded text ----------------------------------------------------------------------------------


def test_default_text_is_sizeable_varied_prose():
    text = default_calibration_text()
    paras = [p for p in text.split("\n\n") if p.strip()]
    assert 40_000 <= len(text.encode()) <= 60_000
    assert len(paras) >= 50 and min(len(p) for p in paras) > 300
    assert text.isascii()
    for word in ("photosynthesis", "railway", "sonnet", "delta", "compiler", "printing"):
        assert word in text.lower()


def test_default_dataset_batches(tok):
    batches = load_calibration_batches(
        DataArgs("default", num_calibration_samples=8, max_seq_length=64, batch_size=4), tok
    )
    assert [tuple(b["input_ids"].shape) for b in batches] == [(4, 64), (4, 64)]
    assert all(
        b["input_ids"].dtype == torch.long and b["attention_mask"].dtype == torch.long for b in batches
    )
    assert all(bool(b["attention_mask"].all()) for b in batches)  # every paragraph is longer than 64 tokens


# ---- files -------------------------------------------------------------------------------------------------


def test_txt_paragraphs_drop_headings_and_fragments(tmp_path, tok):
    text = f" = Geography = \n\n{PARAS[0]}\n = = Rivers = = \n{PARAS[1]}\n\n \n\nshort line\n\n\n{PARAS[2]}\n"
    for suffix in (".txt", ".raw"):
        path = tmp_path / f"calib{suffix}"
        path.write_text(text, encoding="utf-8")
        got = rows_of(load(str(path), tok, batch_size=2))
        assert got == [ids_of(tok, f"{PARAS[0]}\n{PARAS[1]}"), ids_of(tok, PARAS[2])]
    assert len("short line") < MIN_PARAGRAPH_CHARS


def test_jsonl_text_column_and_custom_column(tmp_path, tok):
    path = tmp_path / "calib.jsonl"
    path.write_text(
        "\n".join(json.dumps({"text": p, "body": p.upper(), "id": i}) for i, p in enumerate(PARAS[:3]))
        + "\n\n"
    )
    assert rows_of(load(path, tok)) == [ids_of(tok, p) for p in PARAS[:3]]
    assert rows_of(load(path, tok, text_column="body")) == [ids_of(tok, p.upper()) for p in PARAS[:3]]


@pytest.mark.parametrize("layout", ["list", "columns", "lines"])
def test_json_layouts(tmp_path, tok, layout):
    path = tmp_path / "calib.json"
    rows = [{"text": p} for p in PARAS[:3]]
    if layout == "list":
        path.write_text(json.dumps(rows))
    elif layout == "columns":
        path.write_text(json.dumps({"text": PARAS[:3], "id": [0, 1, 2]}))
    else:  # what datasets' to_json writes
        path.write_text("\n".join(map(json.dumps, rows)))
    assert rows_of(load(path, tok)) == [ids_of(tok, p) for p in PARAS[:3]]


def test_csv_rows(tmp_path, tok):
    path = tmp_path / "calib.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["id", "content"])
        writer.writeheader()
        writer.writerows({"id": i, "content": p + ", with a comma"} for i, p in enumerate(PARAS[:3]))
    assert rows_of(load(path, tok, text_column="content")) == [
        ids_of(tok, p + ", with a comma") for p in PARAS[:3]
    ]


def test_parquet_rows_and_missing_pyarrow(tmp_path, tok, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "calib.parquet"
    pq.write_table(pa.table({"text": PARAS[:3]}), path)
    assert rows_of(load(path, tok)) == [ids_of(tok, p) for p in PARAS[:3]]
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(CalibrationDataError, match=r"needs the optional package pyarrow.*\.jsonl"):
        load(path, tok)


# ---- chat ---------------------------------------------------------------------------------------------------


def conversation(i: int) -> list[dict]:
    return [{"role": "user", "content": PARAS[i]}, {"role": "assistant", "content": PARAS[i + 1]}]


def test_chat_conversations_use_the_template_without_extra_bos(tmp_path, tok):
    convs = [conversation(0), conversation(2)]
    expected = [
        tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"] for c in convs
    ]
    assert expected[0].count(2) == 2  # one <bos> per message, from the template only
    assert rows_of(load(convs, tok)) == expected
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": c}) for c in convs))
    assert rows_of(load(path, tok)) == expected


def test_chat_without_template_is_an_error(tok):
    with pytest.raises(CalibrationDataError, match=r"row 0.*no chat_template.*set tokenizer.chat_template"):
        load([conversation(0)], make_tokenizer(chat=False))
    with pytest.raises(
        CalibrationDataError, match=r"columns: \['content', 'role'\] \(one conversation is a list"
    ):
        load(conversation(0), tok)  # a bare conversation: its messages would be rows


# ---- Python objects and tensors -------------------------------------------------------------------------------


def test_list_of_strings_skips_empty_rows(tok):
    assert rows_of(load(["", PARAS[0], "   ", " = Heading = ", PARAS[1]], tok)) == [
        ids_of(tok, p) for p in PARAS[:2]
    ]


def test_pretokenized_inputs_strip_padding(tok):
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    expected = [[5, 6, 7], [8, 9, 10, 11, 12]]
    assert rows_of(load({"input_ids": ids, "attention_mask": mask}, tok)) == expected
    assert rows_of(load({"input_ids": ids.tolist(), "attention_mask": mask.tolist()}, tok)) == expected
    assert rows_of(load([{"input_ids": [5, 6, 7]}, {"input_ids": torch.tensor([8, 9])}], tok)) == [
        [5, 6, 7],
        [8, 9],
    ]
    assert rows_of(load(ids, tok)) == ids.tolist()
    assert rows_of(load(ids[1], tok, max_seq_length=3)) == [[8, 9, 10]]
    assert rows_of(load([[5, 6], [7, 8, 9]], None)) == [[5, 6], [7, 8, 9]]  # token ids need no tokenizer
    with pytest.raises(CalibrationDataError, match="integer tensor"):
        load(ids.float(), tok)


def test_dict_of_columns(tok):
    assert rows_of(load({"text": PARAS[:2], "id": [0, 1]}, tok)) == [ids_of(tok, p) for p in PARAS[:2]]
    with pytest.raises(CalibrationDataError, match=r"keys \['a'\].*input_ids"):
        load({"a": 1}, tok)


def test_dataloader_batches_pass_through(tok, caplog):
    data = [{"input_ids": torch.arange(i, i + 6), "labels": torch.arange(6)} for i in range(5)]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    batches = load_calibration_batches(DataArgs(loader, num_calibration_samples=3, max_seq_length=4), tok)
    assert len(batches) == 2  # whole batches until 3 rows are covered
    assert torch.equal(batches[0]["input_ids"], torch.stack([torch.arange(0, 4), torch.arange(1, 5)]))
    assert torch.equal(batches[0]["attention_mask"], torch.ones(2, 4, dtype=torch.long))
    assert batches[0]["labels"].shape == (2, 4)
    with caplog.at_level(logging.WARNING, logger="seqcal.data.batches"):
        assert len(load_calibration_batches(DataArgs(loader, num_calibration_samples=100), tok)) == 3
    assert "fewer than the 100 requested" in caplog.text
    bad = torch.utils.data.DataLoader([{"text": "x"}], batch_size=1)
    with pytest.raises(CalibrationDataError, match=r"DataLoader batch 0: expected a dict with 'input_ids'"):
        load_calibration_batches(DataArgs(bad), tok)


# ---- HF datasets (optional package) --------------------------------------------------------------------------


def test_hf_dataset_and_splits(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_dict({"text": PARAS[:4]})
    dd = datasets.DatasetDict({"train": train, "validation": datasets.Dataset.from_dict({"text": PARAS[4:]})})
    assert rows_of(load(train, tok)) == [ids_of(tok, p) for p in PARAS[:4]]
    assert rows_of(load(train, tok, splits="train[1:3]")) == [ids_of(tok, p) for p in PARAS[1:3]]
    assert rows_of(load(dd, tok)) == [ids_of(tok, p) for p in PARAS[:4]]  # "train" by default
    assert rows_of(load(dd, tok, splits={"calibration": "validation"})) == [ids_of(tok, p) for p in PARAS[4:]]
    assert rows_of(load(dd, tok, splits="train[:50%]")) == [ids_of(tok, p) for p in PARAS[:2]]
    with pytest.raises(CalibrationDataError, match=r"no split 'test'.*\['train', 'validation'\]"):
        load(dd, tok, splits="test")
    dd.save_to_disk(str(tmp_path / "saved"))
    assert rows_of(load(str(tmp_path / "saved"), tok, splits="validation")) == [
        ids_of(tok, p) for p in PARAS[4:]
    ]
    with pytest.raises(CalibrationDataError, match=r"no column 'text'; columns: \['body'\]"):
        load(datasets.Dataset.from_dict({"body": PARAS[:2]}), tok)


def test_hub_name_offline_is_a_clear_error(tok, monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/calib' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConnectionError, match=r"offline.*Pass a local file instead.*calib\.txt.*'default'"):
        load("org/calib", tok)


def test_hub_name_loads_through_datasets(tok, monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake(name, config, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict({"text": PARAS[:3]})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    got = load("org/calib", tok, splits="train[:3]", dataset_config_name="raw")
    assert calls == [("org/calib", "raw", "train[:3]")]
    assert rows_of(got) == [ids_of(tok, p) for p in PARAS[:3]]  # the slice is not applied twice


def test_hub_name_without_datasets_installed(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(CalibrationDataError, match=r"Hugging Face Hub.*pip install datasets.*local file"):
        load("org/calib", tok)


# ---- selection, truncation, padding, concatenation ----------------------------------------------------------------


def test_shuffle_is_seeded_and_selects_after_shuffling(tok):
    texts = [f"Sample number {i} says something about rivers and hills." for i in range(20)]
    args = dict(num_calibration_samples=5, shuffle_calibration_samples=True)
    first = rows_of(load(texts, tok, seed=7, **args))
    assert first == rows_of(load(texts, tok, seed=7, **args))
    order = list(range(20))
    random.Random(7).shuffle(order)
    assert first == [ids_of(tok, texts[i]) for i in order[:5]]
    assert first != rows_of(load(texts, tok, seed=8, **args))
    assert rows_of(load(texts, tok, num_calibration_samples=5)) == [ids_of(tok, t) for t in texts[:5]]


def test_truncation_keeps_the_prefix(tok):
    long = " ".join(PARAS)
    (row,) = rows_of(load([long], tok, max_seq_length=17))
    assert row == ids_of(tok, long)[:17] and len(ids_of(tok, long)) > 17


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_and_mask(side):
    tok = make_tokenizer(padding_side=side)
    texts = [PARAS[0], "Short sample text for padding tests.", PARAS[1][:50]]
    (batch,) = load(texts, tok, batch_size=3)
    lengths = [len(ids_of(tok, t)) for t in texts]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for row, mask, text, n in zip(batch["input_ids"], batch["attention_mask"], texts, lengths):
        real = slice(len(row) - n, None) if side == "left" else slice(0, n)
        assert row[real].tolist() == ids_of(tok, text) and bool(mask[real].all())
        assert int(mask.sum()) == n and set(row[mask == 0].tolist()) <= {tok.pad_token_id}
    assert tok.pad_token_id == 0
    no_pad = make_tokenizer(padding_side=side, pad=False)
    (batch,) = load(texts, no_pad, batch_size=3)
    assert set(batch["input_ids"][batch["attention_mask"] == 0].tolist()) == {no_pad.eos_token_id}


def test_concatenate_cuts_full_windows(tok, caplog):
    joined = ids_of(tok, "\n\n".join(PARAS))
    T = 16
    got = rows_of(
        load(PARAS, tok, concatenate=True, max_seq_length=T, num_calibration_samples=3, batch_size=2)
    )
    assert got == [joined[i * T : (i + 1) * T] for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="seqcal.data.batches"):
        got = rows_of(load(PARAS, tok, concatenate=True, max_seq_length=T, num_calibration_samples=10_000))
    assert len(got) == len(joined) // T and all(len(r) == T for r in got)
    assert "fewer than the 10000 requested" in caplog.text
    assert rows_of(load([[1, 2, 3], [4, 5, 6, 7]], None, concatenate=True, max_seq_length=3)) == [
        [1, 2, 3],
        [4, 5, 6],
    ]
    with pytest.raises(CalibrationDataError, match=r"at least max_seq_length=100000 tokens"):
        load(PARAS, tok, concatenate=True, max_seq_length=100_000)


def test_concatenate_on_wikitext_drops_headings(tok):
    path = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wiki.valid.raw"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    batches = load(
        str(path), tok, concatenate=True, max_seq_length=256, num_calibration_samples=8, batch_size=4
    )
    assert [tuple(b["input_ids"].shape) for b in batches] == [(4, 256), (4, 256)]
    assert " = Homarus gammarus = " not in tok.decode(batches[0]["input_ids"][0])


def test_fewer_samples_than_requested_warns(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="seqcal.data.batches"):
        assert len(load([*PARAS[:2], ""], tok, num_calibration_samples=512)) == 2
    tokens = len(ids_of(tok, PARAS[0])) + len(ids_of(tok, PARAS[1]))
    assert f"gives 2 calibration samples ({tokens} tokens), fewer than the 512 requested" in caplog.text
    assert "(up to 2048 tokens each): it has 3 rows, 1 of them empty or headings" in caplog.text


def test_a_one_line_file_is_used_and_its_size_explained(tmp_path, tok, caplog):
    hello = tmp_path / "hello.txt"
    hello.write_text("Hello world.\n")  # 13 bytes: one paragraph, shorter than MIN_PARAGRAPH_CHARS
    with caplog.at_level(logging.WARNING, logger="seqcal.data"):
        assert rows_of(load(str(hello), tok, num_calibration_samples=4, max_seq_length=64)) == [
            ids_of(tok, "Hello world.")
        ]
    tokens = len(ids_of(tok, "Hello world."))
    assert (
        f"every paragraph is shorter than {MIN_PARAGRAPH_CHARS} characters (13 bytes in all)" in caplog.text
    )
    assert f"{hello} gives 1 calibration sample ({tokens} tokens), fewer than the 4 requested" in caplog.text
    assert "(up to 64 tokens each): it has 1 row (one sample per row" in caplog.text
    with pytest.raises(CalibrationDataError, match=rf"at least max_seq_length=64 tokens .* has {tokens}"):
        load(str(hello), tok, max_seq_length=64, concatenate=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="seqcal.data"):
        got = load([" ".join(PARAS)], tok, num_calibration_samples=50, max_seq_length=16, concatenate=True)
    assert (
        f"gives {len(rows_of(got))} calibration samples" in caplog.text
        and "windows of 16 tokens" in caplog.text
    )


# ---- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_calibration_samples": 0}, r"num_calibration_samples must be a positive int, got 0"),
        ({"max_seq_length": -1}, r"max_seq_length must be a positive int, got -1"),
        ({"batch_size": 0}, r"batch_size must be a positive int or 'auto', got 0"),
        ({"batch_size": True}, r"batch_size must be a positive int or 'auto', got True"),
        ({"text_column": ""}, r"text_column must be a non-empty column name"),
        ({"splits": {"a": "x", "b": "y"}}, r"'calibration' key"),
        ({"splits": "train[::2]"}, r"is not a split"),
        ({"concatenate": "yes"}, r"concatenate must be True or False"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataArgs("default", **kwargs)


def test_unknown_dataset_kind_lists_what_is_accepted():
    with pytest.raises(
        CalibrationDataError, match=r"cannot use a set; accepted: 'default'.*local file.*DataLoader"
    ):
        DataArgs({1, 2})


def test_file_errors(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match=r"'missing\.jsonl' does not exist.*working folder"):
        load("missing.jsonl", tok)
    bad = tmp_path / "calib.xlsx"
    bad.write_text("x")
    with pytest.raises(CalibrationDataError, match=r"unknown extension '\.xlsx'; accepted: \.txt.*\.parquet"):
        load(str(bad), tok)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"body": "x" * 40, "id": 1}))
    with pytest.raises(
        CalibrationDataError, match=r"rows\.jsonl:1: no column 'text'; columns: \['body', 'id'\]"
    ):
        load(rows, tok)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(CalibrationDataError, match=r"broken\.jsonl:2: not valid JSON"):
        load(broken, tok)


def test_empty_datasets(tmp_path, tok):
    with pytest.raises(CalibrationDataError, match="is empty"):
        load([], tok)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(CalibrationDataError, match="is empty"):
        load(str(empty), tok)
    headings = tmp_path / "headings.txt"
    headings.write_text(" = A = \n\nshort\n\n = = B = = \n\nalso a rather long paragraph that survives.\n")
    assert len(rows_of(load(str(headings), tok))) == 1
    with pytest.raises(CalibrationDataError, match=r"2 rows but no usable sample"):
        load(["", "  "], tok)


def test_tokenizer_without_pad_or_eos(tok):
    bare = make_tokenizer(pad=False, eos=False)
    with pytest.raises(
        CalibrationDataError, match=r"neither a pad_token nor an eos_token; set tokenizer.pad_token"
    ):
        load(PARAS, bare, batch_size=2)
    assert len(load(PARAS, bare, batch_size=1)) == len(PARAS)  # nothing to pad
    with pytest.raises(CalibrationDataError, match="text samples need a tokenizer"):
        load(PARAS, None)
