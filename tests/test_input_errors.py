"""Careless input gets a precise, one-sentence answer before anything is calibrated or written.

Each test passes what a new user might: two modifiers claiming one Linear, a typo in a target, chat rows
whose 'messages' is a string, a malformed JSON lines row, a checkpoint quantized in an unknown format, a folder
without config.json or tokenizer, a max_seq_length past the model's positions. The last part checks that
target inference uses the layer classes a model declares (``_no_split_modules``).
"""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from seqcal import trace_subgraphs
from seqcal.data import CalibrationDataError, DataArgs, load_calibration_batches
from seqcal.entrypoint import oneshot
from seqcal.modifiers import GPTQModifier, QuantizationModifier, RunState
from seqcal.recipe.parse import Recipe, RecipeError, parse_recipe
from seqcal.tracing.targets import infer_candidates
from test_data import make_tokenizer

SRC = Path(__file__).parent.parent / "src" / "seqcal"
TEXT = "Rivers carry water and sediment from the hills down to the sea, building wide plains."


def tiny_llama(
    vocab: int = 256, hidden: int = 128, layers: int = 2, positions: int = 128
) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def token_data(n: int = 2, length: int = 16) -> list[dict[str, list[int]]]:
    return [{"input_ids": [(7 * i + j) % 200 + 3 for j in range(length)]} for i in range(n)]


# ---- 1. two modifiers claiming the same Linear ---------------------------------------------------------


def test_two_modifiers_on_the_same_linear_are_refused_before_calibrating(tmp_path: Path) -> None:
    recipe = [GPTQModifier(scheme="W4A16", ignore=["lm_head"]), QuantizationModifier(scheme="W8A8")]
    out = tmp_path / "out"
    with pytest.raises(RecipeError) as err:
        oneshot(model=tiny_llama(), dataset=token_data(), recipe=recipe, output_dir=str(out))
    message = str(err.value)
    assert "GPTQModifier (modifier 1) and QuantizationModifier (modifier 2)" in message
    assert "model.layers.0.self_attn.q_proj" in message and "ignore" in message
    assert not out.exists()


def test_overlap_in_a_yaml_recipe_names_both_stages_modifiers() -> None:
    recipe = parse_recipe(
        "a_stage: {a_modifiers: {QuantizationModifier: {scheme: W8A8, targets: ['re:.*mlp.*']}}}\n"
        "b_stage: {b_modifiers: {GPTQModifier: {scheme: W4A16, targets: [Linear], ignore: [lm_head]}}}\n"
    )
    with pytest.raises(RecipeError, match=r"QuantizationModifier .* GPTQModifier .*mlp\.(gate|up|down)_proj"):
        recipe.validate(tiny_llama())


def test_modifiers_on_disjoint_modules_are_accepted() -> None:
    recipe = Recipe([
        QuantizationModifier(scheme="W8A8", targets=["re:.*mlp.*"]),
        GPTQModifier(scheme="W4A16", targets=["re:.*self_attn.*"]),
    ])  # fmt: skip
    recipe.validate(tiny_llama())
    attn, mlp = set(recipe.modifiers[1].modules), set(recipe.modifiers[0].modules)
    assert attn and mlp and not attn & mlp


# ---- 6. target and ignore typos ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "pattern", "close"),
    [
        ({"targets": ["Linaer"]}, "'Linaer'", "did you mean 'Linear'"),
        ({"targets": ["re:.*q_prj"]}, "'re:.*q_prj'", "q_proj"),
    ],
)
def test_a_pattern_that_matches_nothing_is_named_with_close_matches(kwargs, pattern, close) -> None:
    with pytest.raises(ValueError) as err:
        GPTQModifier(scheme="W4A16", **kwargs).validate(tiny_llama())
    message = str(err.value)
    assert message.startswith("GPTQModifier: ") and "matches no module of LlamaForCausalLM" in message
    assert pattern in message and close in message


def test_an_ignore_entry_for_modules_this_model_lacks_only_warns(caplog) -> None:
    """A recipe shared across architectures ignores things (vision towers) some models do not have."""
    modifier = GPTQModifier(scheme="W4A16", ignore=["lm_head", "re:.*(vision|visual).*"])
    with caplog.at_level(logging.WARNING, logger="seqcal"):
        modifier.validate(tiny_llama())
    assert "ignore entry 're:.*(vision|visual).*' matches no module of LlamaForCausalLM" in caplog.text
    assert "lm_head" not in modifier.modules and "model.layers.0.mlp.up_proj" in modifier.modules


def test_an_ignore_typo_warns_with_the_close_name_and_reaches_the_report() -> None:
    """An ignore entry that matches nothing is a warning (log and report), with the closest names; the module it
    meant to keep is quantized, which the warning says."""
    modifier, state = GPTQModifier(scheme="W4A16", ignore=["lm_haed"]), RunState()
    modifier.initialize(tiny_llama(), state)
    (line,) = state.results.log
    assert "ignore entry 'lm_haed' matches no module of LlamaForCausalLM (did you mean 'lm_head'?)" in line
    assert "lm_head" in modifier.modules


def test_target_typo_in_a_yaml_recipe_stops_oneshot(tmp_path: Path) -> None:
    recipe = "quant_stage: {quant_modifiers: {GPTQModifier: {scheme: W4A16, targets: [Linaer]}}}"
    with pytest.raises(ValueError, match="targets entry 'Linaer' matches no module.*'Linear'"):
        oneshot(model=tiny_llama(), dataset=token_data(), recipe=recipe, output_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# ---- 2. chat rows whose messages is not a list ---------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "got"),
    [
        ("hello there, how are you today?", "got a str"),
        ({"role": "user", "content": "hi"}, "got a dict"),
        (["just text"], "whose item 'just text' is not a {'role', 'content'} dict"),
    ],
)
def test_chat_row_whose_messages_is_not_a_list_names_the_row(messages, got) -> None:
    rows = [{"messages": [{"role": "user", "content": TEXT}]}, {"messages": messages}]
    args = DataArgs(rows, shuffle_calibration_samples=False)
    with pytest.raises(CalibrationDataError) as err:
        load_calibration_batches(args, make_tokenizer())
    message = str(err.value)
    assert message.startswith("the dataset list, row 1, column 'messages': expected a list of messages")
    assert got in message


# ---- 7. JSON lines rows by file and line ---------------------------------------------------------------


def test_a_bad_jsonl_row_is_named_by_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "calib.jsonl"
    path.write_text(json.dumps({"text": TEXT}) + "\n\n" + json.dumps({"txt": TEXT}) + "\n", encoding="utf-8")
    with pytest.raises(CalibrationDataError, match=rf"^{path}:3: no column 'text'; columns: \['txt'\]"):
        load_calibration_batches(DataArgs(str(path), shuffle_calibration_samples=False), make_tokenizer())


def test_a_malformed_jsonl_row_and_a_binary_file_are_named_by_line(tmp_path: Path) -> None:
    path = tmp_path / "calib.jsonl"
    path.write_text(json.dumps({"text": TEXT}) + "\n\n" + '{"text": "unclosed\n', encoding="utf-8")
    with pytest.raises(CalibrationDataError, match=rf"^{path}:3: not valid JSON"):
        load_calibration_batches(DataArgs(str(path)), make_tokenizer())
    binary = tmp_path / "weights.jsonl"
    binary.write_bytes(b"\x93NUMPY\xff\xfe\x00\x01")
    with pytest.raises(CalibrationDataError, match=rf"^{binary}:1: not UTF-8 text .*is it the right file"):
        load_calibration_batches(DataArgs(str(binary)), make_tokenizer())


def test_a_byte_order_mark_does_not_spoil_the_first_row(tmp_path: Path) -> None:
    path = tmp_path / "calib.jsonl"
    path.write_text("\ufeff" + json.dumps({"text": TEXT}) + "\n", encoding="utf-8")
    batches = load_calibration_batches(DataArgs(str(path)), make_tokenizer())
    assert batches[0]["input_ids"].shape[0] == 1


# ---- 4, 5. model directories ---------------------------------------------------------------------------


def test_a_checkpoint_quantized_in_an_unknown_format_is_refused_before_loading(tmp_path: Path) -> None:
    model_dir = tmp_path / "llama-hqq"
    model_dir.mkdir()
    config = tiny_llama().config.to_dict() | {"quantization_config": {"quant_method": "hqq"}}
    (model_dir / "config.json").write_text(json.dumps(config))  # no weights at all: loading would fail
    with pytest.raises(ValueError) as err:
        oneshot(model=str(model_dir), dataset=token_data(), recipe=GPTQModifier(scheme="W4A16"))
    message = str(err.value)
    assert f"{model_dir / 'config.json'}: quantization_config has quant_method 'hqq'" in message
    assert "cannot dequantize" in message and "'fp8'" in message


def test_a_seqcal_output_directory_is_requantized_only_when_asked(tmp_path: Path) -> None:
    out = tmp_path / "w8"
    recipe = QuantizationModifier(scheme="W8A16", ignore=["lm_head"])
    oneshot(model=tiny_llama(), dataset=token_data(), recipe=recipe, output_dir=str(out))
    with pytest.raises(
        ValueError, match=r"stored as int8-pack-quantized \(8-bit int\), at or below .* requantize=True"
    ):
        oneshot(model=str(out), dataset=token_data(), recipe=recipe, output_dir=str(tmp_path / "again"))
    assert not (tmp_path / "again").exists()


def test_a_directory_without_config_says_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "config.json").write_text("{}")
    with pytest.raises(ValueError) as err:
        oneshot(model=str(tmp_path), dataset=token_data(), recipe=GPTQModifier(scheme="W4A16"))
    message = str(err.value)
    assert (
        f"model directory {str(tmp_path)!r} has no config.json (it holds: model.safetensors, snapshot/)"
        in message
    )
    assert f"pass {str(tmp_path / 'snapshot')!r}" in message


@pytest.fixture
def model_without_tokenizer(tmp_path: Path) -> Path:
    tiny_llama().save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_text_data_without_a_tokenizer_names_the_directory_and_the_fix(
    model_without_tokenizer: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError) as err:
        oneshot(model=str(model_without_tokenizer), dataset=[TEXT], recipe=GPTQModifier(scheme="W4A16"),
                output_dir=str(tmp_path / "out"))  # fmt: skip
    message = str(err.value)
    assert f"the model directory {str(model_without_tokenizer)!r} has no tokenizer" in message
    assert "pass tokenizer=" in message and "token-id data" in message
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_directory_or_token_ids_make_the_same_model_run(
    model_without_tokenizer: Path, tmp_path: Path
) -> None:
    make_tokenizer().save_pretrained(tmp_path / "tok")
    recipe = QuantizationModifier(scheme="W8A16", ignore=["lm_head"])
    run = {"model": str(model_without_tokenizer), "recipe": recipe, "num_calibration_samples": 2}
    assert oneshot(dataset=[TEXT], tokenizer=str(tmp_path / "tok"), **run) is not None
    assert oneshot(dataset=token_data(), **run) is not None


# ---- 3. max_seq_length past the model's positions ------------------------------------------------------


def test_max_seq_length_past_the_positions_warns_with_both_numbers(caplog) -> None:
    from seqcal.data.checks import check_max_seq_length

    with caplog.at_level(logging.WARNING, logger="seqcal"):
        check_max_seq_length(tiny_llama(positions=128), DataArgs("default", max_seq_length=4096))
    assert "max_seq_length=4096 is beyond the 128 positions" in caplog.text
    assert "set max_seq_length=128 or less" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="seqcal"):
        check_max_seq_length(tiny_llama(positions=128), DataArgs("default", max_seq_length=128))
    assert caplog.text == ""


def test_a_multimodal_model_is_checked_against_its_text_config(caplog) -> None:
    from transformers import LlavaConfig

    from seqcal.data.checks import check_max_seq_length

    model = torch.nn.Module()
    model.config = LlavaConfig(text_config={"model_type": "llama", "max_position_embeddings": 64})
    with caplog.at_level(logging.WARNING, logger="seqcal"):
        check_max_seq_length(model, DataArgs("default", max_seq_length=100))
    assert "max_seq_length=100 is beyond the 64 positions" in caplog.text


def test_concatenated_windows_past_the_positions_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_seq_length=512 is beyond the 128 positions.*concatenate=True"):
        oneshot(model=tiny_llama(vocab=512, positions=128), tokenizer=make_tokenizer(), dataset="default",
                recipe=GPTQModifier(scheme="W4A16"), max_seq_length=512, concatenate=True,
                output_dir=str(tmp_path / "out"))  # fmt: skip
    assert not (tmp_path / "out").exists()


# ---- 8. target inference uses the declared layer class -------------------------------------------------


def test_small_model_with_a_large_vocabulary_gets_its_layers_as_targets() -> None:
    model = tiny_llama(vocab=49152, hidden=64, layers=3)
    sample = {
        "input_ids": torch.arange(3, 19).view(1, 16),
        "attention_mask": torch.ones(1, 16, dtype=torch.long),
    }
    subgraphs = trace_subgraphs(model, sample)
    assert subgraphs.targets == ["model.layers.0", "model.layers.1", "model.layers.2"]
    with torch.no_grad():
        want = model(**sample).logits
    torch.testing.assert_close(subgraphs.run(**sample).logits, want, atol=1e-5, rtol=0)


def test_a_model_that_declares_nothing_falls_back_to_the_largest_stack() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(32, 32)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
            self.heads = torch.nn.ModuleList(Block() for _ in range(1))
            self.head = torch.nn.Linear(32, 64)

    assert sorted(infer_candidates(Net()).values()) == ["blocks.0", "blocks.1", "blocks.2", "heads.0"]
    Net._no_split_modules = ["Missing"]
    assert len(infer_candidates(Net())) == 4  # a declared class absent from every stack changes nothing


def test_a_declared_class_takes_its_whole_stack_in_a_hybrid_model() -> None:
    """Hybrid models alternate layer classes in one list; declaring one of them is enough."""

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

    class Mamba(Attn):
        pass

    class Hybrid(torch.nn.Module):
        _no_split_modules = ["Attn"]

        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(50000, 8)  # the layers hold far under 10% of the parameters
            self.layers = torch.nn.ModuleList([Attn(), Mamba(), Attn()])

    assert sorted(infer_candidates(Hybrid()).values()) == ["layers.0", "layers.1", "layers.2"]


# ---- 9. data modules import without a cycle ------------------------------------------------------------


def test_data_args_is_one_class_and_data_modules_do_not_import_each_other_back() -> None:
    from seqcal.data import DataArgs as from_package
    from seqcal.data.args import DataArgs as from_args
    from seqcal.data.batches import DataArgs as from_batches

    assert from_package is from_args is from_batches

    def imports(name: str) -> set[str]:
        tree = ast.parse((SRC / "data" / f"{name}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    # args is the base of the data package: it imports only leaves of it (modules importing nothing from it)
    below = {m for m in imports("args") if m.startswith("seqcal.data")}
    assert below <= {"seqcal.data.autobatch"}
    assert not {m for leaf in below for m in imports(leaf.rsplit(".", 1)[1]) if m.startswith("seqcal.data")}
    assert "seqcal.data.batches" not in imports("sources")
