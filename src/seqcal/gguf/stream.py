"""The GGUF file written as subgraphs finish (``output_format="gguf"``), never the whole model in memory.

A GGUF file is a header (metadata, then each tensor's name, shape, type and offset) followed by the tensors'
data. The data is known one subgraph at a time, so each finished module's tensors are packed, checked
(``seqcal.gguf.tensors``) and appended to ``model.gguf.data.partial`` at once, their codes then dropped from
memory as the safetensors writer does. At the end the header is written with gguf-py's ``GGUFWriter`` (which
computes the same offsets from the same sizes and alignment) into ``model.gguf``, the data copied after it, and
the file read back with ``gguf.GGUFReader``: every tensor's bytes must be the ones that were checked.

Resume is not offered for GGUF output (``OutputArgs`` refuses it before the run).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from seqcal.gguf.families import add_hparams, family_of, tensor_namer, text_config, tied_output
from seqcal.gguf.scheme import GGUFScheme
from seqcal.gguf.tensors import Entry, FilePlan, GGUFCheckError, module_entries, plan_types
from seqcal.gguf.vocab import add_tokenizer
from seqcal.owners import module_owners

logger = logging.getLogger("seqcal")

FILE_NAME = "model.gguf"
_PARTIAL = FILE_NAME + ".data.partial"


def file_plan(model: torch.nn.Module, schemes: Sequence[Any]) -> FilePlan:
    """The file's family, mix and naming for ``model`` whose quantized modules follow ``schemes``."""
    family = family_of(model.config)
    base, file_type = plan_types([s for s in schemes if isinstance(s, GGUFScheme)])
    tied = tied_output(model)
    return FilePlan(family, model.config, tensor_namer(family, model.config), base, file_type, tied)


class GGUFStream:
    """``StreamingCheckpoint``'s part for GGUF output, with its arguments: ``done(sg)`` after each subgraph,
    ``finish`` at the end.

    The token embedding and the output projection are written at the end (read again from the weights' store when
    offloaded): their type follows the file's mix, which the modules' own schemes tell only once they are all
    quantized.

    Args:
        model: the model being calibrated.
        state: the run state (its ``results.quantized`` fill as subgraphs finish).
        output_dir: the directory of ``model.gguf``.
        subgraphs: the run's subgraphs (a module is written after the last one that uses it); empty: all at the end.
        run_id, overwrite, resume, batches, profiler, background: ``StreamingCheckpoint``'s; the file is written
            synchronously, and a resume was refused before the run (``OutputArgs``).
        weights: the subgraph weights reader when parameters live off the model (offloaded), else None.
    """

    finished = -1  # nothing to resume
    resumed_empty = False

    def __init__(self, model: torch.nn.Module, state: Any, output_dir: str | Path, subgraphs: Sequence[Any],
                 run_id: Any = None, *, weights: Any = None, **_: Any) -> None:  # fmt: skip
        self.model, self.state, self.weights = model, state, weights
        self.path = Path(output_dir)
        self.path.mkdir(parents=True, exist_ok=True)
        self.plan = file_plan(model, [])  # its mix is known at the end
        self.entries: list[tuple[str, tuple[int, ...], int, np.dtype, int, str]] = []
        self.data = open(self.path / _PARTIAL, "wb")  # noqa: SIM115 - closed by finish / close
        self.owner = module_owners(model, subgraphs, buffers=False)
        for edge in (model.get_input_embeddings(), model.get_output_embeddings()):
            self.owner.update({n: -1 for n, m in model.named_modules() if m is edge})

    def done(self, sg: Any) -> float:
        """Write the modules ``sg`` used last; returns 0.0 (no background writes to wait for)."""
        self._write([n for n, i in self.owner.items() if i == sg.index])
        return 0.0

    def _write(self, names: list[str]) -> None:
        quantized = self.state.results.quantized
        with self.weights.modules_onloaded(names) if self.weights else contextlib.nullcontext():
            for name in names:
                qw = quantized.get(name)
                for entry in module_entries(name, self.model.get_submodule(name), qw, self.plan):
                    self._append(entry)
                if qw is not None:  # only its scheme is needed from here on
                    empty = torch.empty(0)
                    quantized[name] = replace(qw, q=empty, scale=empty, zero_point=None, g_idx=None)

    def _append(self, entry: Entry) -> None:
        raw = np.ascontiguousarray(entry.data)
        digest = hashlib.sha256(raw.tobytes()).hexdigest()
        self.entries.append((entry.name, raw.shape, entry.ggml_type, raw.dtype, raw.nbytes, digest))
        self.data.write(raw.tobytes())
        pad = gguf.GGUFWriter.ggml_pad(raw.nbytes, gguf.GGUF_DEFAULT_ALIGNMENT) - raw.nbytes
        self.data.write(bytes(pad))
        entry.data = np.empty(0, dtype=np.uint8)

    def drain(self, raise_errors: bool = True) -> float:
        return 0.0

    def close(self) -> None:
        if not self.data.closed:
            self.data.close()

    def finish(self, tokenizer: Any = None, recipe_yaml: str | None = None) -> Path:
        """Write the modules no subgraph used, then ``model.gguf`` (header, then the data), and check it."""
        self.plan = file_plan(self.model, [q.scheme for q in self.state.results.quantized.values()])
        self._write([n for n, i in self.owner.items() if i == -1])
        self.close()
        plan, target = self.plan, self.path / FILE_NAME
        writer = gguf.GGUFWriter(target, plan.family.arch)
        add_hparams(writer, plan.config, getattr(self.model, "name_or_path", "") or plan.family.arch)
        writer.add_file_type(plan.file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_tokenizer(writer, tokenizer, text_config(plan.config).vocab_size)
        for name, shape, kind, dtype, nbytes, _ in self.entries:
            raw = None if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else kind
            writer.add_tensor_info(name, shape, dtype, nbytes, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        out = writer.fout[0]
        writer.write_padding(out, out.tell())
        with open(self.path / _PARTIAL, "rb") as data:
            shutil.copyfileobj(data, out, 16 * 2**20)
        writer.close()
        (self.path / _PARTIAL).unlink()
        if recipe_yaml is not None:
            (self.path / "recipe.yaml").write_text(recipe_yaml)
        self._check(target)
        return target

    def _check(self, target: Path) -> None:
        """Every tensor in the file holds the bytes that were checked against seqcal's weights."""
        digests = {name: digest for name, *_, digest in self.entries}
        for tensor in gguf.GGUFReader(target).tensors:
            data = np.ascontiguousarray(tensor.data)
            if hashlib.sha256(data.tobytes()).hexdigest() != digests.get(tensor.name):
                raise GGUFCheckError(f"GGUF check: {target} holds other bytes for {tensor.name} than were checked; "
                                     "the file is corrupt: write it again")  # fmt: skip
        logger.info("seqcal: wrote %s (%d tensors, %.1f MB), each tensor checked against the quantized weights",
                    target, len(digests), target.stat().st_size / 1e6)  # fmt: skip


def export_gguf(model: torch.nn.Module, tokenizer: Any, output_dir: str | Path) -> Path:
    """``model`` as it is (its float weights, the token embedding included) in ``output_dir/model.gguf``: the
    input llama.cpp's own ``llama-quantize`` takes.

    Example:
        >>> export_gguf(AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), "f32")  # doctest: +SKIP
    """
    family_of(model.config)

    @dataclass
    class _Results:
        quantized: dict = field(default_factory=dict)

    @dataclass
    class _State:
        results: _Results = field(default_factory=_Results)

    return GGUFStream(model, _State(), output_dir, []).finish(tokenizer)
