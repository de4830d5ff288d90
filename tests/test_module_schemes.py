"""A module's scheme is part of its result: a modifier that picks a scheme per module gets the same checkpoint
from one process, two, and a run stopped midway and resumed, and config.json describes the packed tensors.

The modifier below is written as docs/modifiers.md tells a user to write one, outside seqcal and named in the
recipe by import path (``test_module_schemes:BitsByErrorModifier``): round to nearest at the fewest of 3, 4 or 8
bits whose error, weighted per input column by the inputs' E[x_j^2] (the Hessian's diagonal), stays under
``max_error``. The tiny Llama's Linears draw their weights from three families (uniform, normal, normal with an outlier column),
so the rule gives every width.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationScheme
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dist_helpers import data, run, stopped_after, tensor_hashes
from seqcal.checkpoint.config import checkpoint_config
from seqcal.cli import main as cli_main
from seqcal.console import console_logging
from seqcal.distributed.exchange import pack, unpack
from seqcal.entrypoint import oneshot
from seqcal.modifiers import Gather, QuantizationModifier, QuantizedWeight
from seqcal.modifiers.base import RunState
from seqcal.recipe.imports import user_modifier_logger

logger = logging.getLogger(__name__)
WIDTHS = (3, 4, 8)


def _error(W: torch.Tensor, d: torch.Tensor, bits: int) -> float:
    """Relative error of W [out, in] rounded to nearest per output channel, weighted by d [in]."""
    scale = W.abs().amax(-1, keepdim=True).clamp(min=1e-12) / (2 ** (bits - 1) - 1)
    Q = (W / scale).round().clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * scale
    return float(((Q - W) ** 2 * d).sum() / (W**2 * d).sum())


def with_bits(scheme: QuantizationScheme, bits: int) -> QuantizationScheme:
    """``scheme`` with ``bits``-bit weights."""
    return scheme.model_copy(update={"weights": scheme.weights.model_copy(update={"num_bits": bits})})


@dataclass
class BitsByErrorModifier(QuantizationModifier):
    """Round to nearest with the recipe's (channel) scheme at the fewest of 3, 4 or 8 bits whose E[x^2]-weighted
    relative error is under ``max_error``."""

    max_error: float = 0.035
    needs_calibration = True
    gathers = (Gather("sq", lambda x: x.pow(2).sum(0)), Gather("tokens", lambda x: x.new_tensor([len(x)])))

    def compress(self, subgraph, model, state) -> bool:
        for name in [n for n in self.modules_in(subgraph) if n not in state.results.quantized]:
            stats = self.gathered(name)
            d = stats["sq"] / stats["tokens"]  # E[x_j^2]
            W = model.get_submodule(name).weight.data.float()
            bits = next((b for b in WIDTHS[:-1] if _error(W, d, b) < self.max_error), WIDTHS[-1])
            self.modules[name] = with_bits(
                self.modules[name], bits
            )  # the scheme this module is quantized with
            logger.info("%s: %d bits", name, bits)
        return super().compress(subgraph, model, state)


RECIPE = """quant_stage:
  quant_modifiers:
    test_module_schemes:BitsByErrorModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 8, type: int, symmetric: true, strategy: channel}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama whose Linears are, in turn, uniform, normal and with an outlier column (3, 4, 8 bits)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config)
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.no_grad():
        for i, m in enumerate(linears):
            w, outlier = torch.randn_like(m.weight), torch.ones(m.weight.shape[1])
            outlier[0] = 8.0  # one input column 8x larger: 4 bits round the others coarsely
            m.weight.copy_(0.02 * (torch.rand_like(w) * 2 - 1, w, w * outlier)[i % 3])
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path


def _args(model_dir: Path, out: Path, **extra: object) -> dict:
    return {"model": str(model_dir), "dataset": data(5, 24), "recipe": RECIPE, "max_seq_length": 24,
            "output_dir": str(out), **extra}  # fmt: skip


def _widths(out: Path) -> dict[str, int]:
    """Module name -> weight bits, as config.json's config groups say."""
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    return {t: g["weights"]["num_bits"] for g in block["config_groups"].values() for t in g["targets"]}


@pytest.fixture(scope="module")
def single(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """The checkpoint of one process, never interrupted (the reference), and the model oneshot returned (given in
    memory: the same bytes as from its directory, and its weights come back fake-quantized)."""
    out = tmp_path_factory.mktemp("runs") / "single"
    model = LlamaForCausalLM.from_pretrained(model_dir)
    return out, oneshot(**{**_args(model_dir, out), "model": model})


def test_the_rule_gives_every_width_and_config_json_says_which(single: tuple[Path, torch.nn.Module]) -> None:
    single = single[0]
    widths = _widths(single)  # three widths: overlapping targets, so the groups name their modules
    assert len(widths) == 14 and sorted(set(widths.values())) == list(WIDTHS), widths
    for file in single.glob("*.safetensors"):  # the packed tensors hold each module's width
        with safe_open(str(file), "pt") as f:
            for name, bits in widths.items():
                packed, shape = f.get_tensor(f"{name}.weight_packed"), f.get_tensor(f"{name}.weight_shape")
                assert packed.shape[1] == -(-int(shape[1]) * bits // 32), (name, bits, packed.shape)


def test_same_bytes_and_config_for_1_and_2_processes(
    model_dir: Path, single: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    """Half the modules are solved by the other process and reach the writer through ``unpack``: with the
    recipe's scheme instead of their own, config.json would call them 8-bit."""
    single = single[0]
    run(2, tmp_path / "err", **_args(model_dir, tmp_path / "two"))
    assert tensor_hashes(tmp_path / "two") == tensor_hashes(single)
    assert (tmp_path / "two" / "config.json").read_bytes() == (single / "config.json").read_bytes()
    owners = json.loads((tmp_path / "two" / "quantization_report.json").read_text())["distributed"]["owners"]
    assert set(owners) == {0, 1}  # the other process solved some subgraphs


def test_stopped_at_several_subgraphs_and_resumed_gives_the_uninterrupted_checkpoint(
    model_dir: Path, single: tuple[Path, torch.nn.Module], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One directory stopped after subgraph 2, then by its resumed runs after 5 and 8 of the 9, then finished:
    each replay rebuilds the modules it restores with the scheme their file records, not the recipe's."""
    out = tmp_path / "stopped"
    for stop, resume in ((2, False), (3, True), (3, True)):
        stopped_after(monkeypatch, stop, **_args(model_dir, out, resume=resume))
    oneshot(**_args(model_dir, out, resume=True))
    assert tensor_hashes(out) == tensor_hashes(single[0])
    assert (out / "config.json").read_bytes() == (single[0] / "config.json").read_bytes()


def test_unpack_keeps_the_scheme_the_solver_quantized_with() -> None:
    """What another process receives carries the sender's scheme, not the recipe's."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    base = QuantizationScheme.model_validate(
        {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        }
    )
    sent = RunState()
    q = torch.randint(-4, 4, (4, 8), dtype=torch.int8)
    sent.results.quantized["0"] = QuantizedWeight(
        q, torch.ones(4, 1), None, None, with_bits(base, 3), loss=0.5
    )
    got = RunState()
    assert unpack(pack(["0"], model, sent, {}), model, got) == ["0"]
    qw = got.results.quantized["0"]
    assert qw.scheme == with_bits(base, 3) and qw.scheme.weights.num_bits == 3 and qw.loss == 0.5
    assert torch.equal(qw.q, q)


def test_config_groups_do_not_depend_on_the_order_results_arrive() -> None:
    """Another process's modules and replayed ones arrive in another order: the groups are numbered in the
    model's order all the same."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model.config = LlamaConfig(vocab_size=8, hidden_size=8, num_attention_heads=1, num_key_value_heads=1)
    base = QuantizationScheme.model_validate(
        {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        }
    )
    blocks = []
    for order in (["0", "1", "2"], ["2", "1", "0"]):
        state = RunState()
        for name in order:
            scheme = with_bits(base, {"0": 4, "1": 8, "2": 4}[name])
            state.results.quantized[name] = QuantizedWeight(
                torch.empty(0), torch.empty(0), None, None, scheme
            )
        blocks.append(checkpoint_config(model, state)["quantization_config"])
    assert blocks[0] == blocks[1]
    assert blocks[0]["config_groups"]["group_0"]["weights"]["num_bits"] == 4


def test_transformers_loads_each_layer_at_its_width(single: tuple[Path, torch.nn.Module]) -> None:
    out, quantized = single
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, bits in _widths(out).items():
        assert loaded.get_submodule(name).quantization_scheme.weights.num_bits == bits, name
    ids = torch.tensor([data(1, 24)[0]["input_ids"]])
    with (
        torch.no_grad()
    ):  # the model seqcal calibrated, fake-quantized, and the checkpoint as transformers runs it
        torch.testing.assert_close(loaded(ids).logits, quantized(ids).logits, rtol=1e-3, atol=1e-3)


def test_a_user_modules_logger_shows_on_the_command_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``logging.getLogger(__name__)`` in the modifier's module prints beside seqcal's lines."""
    recipe, dataset = tmp_path / "recipe.yaml", tmp_path / "calib.jsonl"
    recipe.write_text(RECIPE)
    dataset.write_text("".join(json.dumps(row) + "\n" for row in data(2, 16)))
    args = ["oneshot", "--model", str(model_dir), "--recipe", str(recipe), "--dataset", str(dataset),
            "--max-seq-length", "16", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    assert cli_main(args) == 0
    assert "seqcal: model.layers.0.self_attn.q_proj: 3 bits" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [{}, {"verbose": 1}, {"quiet": True}])
def test_a_user_modules_logger_follows_the_flags(flags: dict) -> None:
    """At the level -v / -q ask for, as seqcal's own; other libraries' lines stay out; the host's logging is
    left as it was."""
    root = logging.getLogger()
    before = root.level, list(root.handlers)
    stream = io.StringIO()
    with console_logging(**flags, stream=stream, shown=user_modifier_logger):
        for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
            logger.log(level, "user %s", logging.getLevelName(level))
            logging.getLogger("seqcal.x").log(level, "own %s", logging.getLevelName(level))
            logging.getLogger("some_library").log(level, "library %s", logging.getLevelName(level))
    lines = stream.getvalue().splitlines()
    least = logging.ERROR if flags.get("quiet") else logging.DEBUG if flags.get("verbose") else logging.INFO
    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
        name = logging.getLevelName(level)
        assert any(f"user {name}" in line for line in lines) == (level >= least), (flags, lines)
        assert any(f"own {name}" in line for line in lines) == (level >= least), (flags, lines)
    assert not any("library" in line for line in lines)  # pytest's handlers are on the root: no last resort
    assert (root.level, root.handlers) == before
