"""oneshot's configuration: one typed value built once from the keywords, llm-compressor's translated inside."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from seqcal.entrypoint import oneshot
from seqcal.run_args import OneshotArgs


def test_the_configuration_has_every_keyword_of_oneshot_with_its_default() -> None:
    params = {n: p.default for n, p in inspect.signature(oneshot).parameters.items() if n != "unknown"}
    fields = {f.name: f.default for f in dataclasses.fields(OneshotArgs)}
    assert fields.keys() == params.keys()
    assert {n: d for n, d in fields.items() if d is not dataclasses.MISSING} == {
        n: d for n, d in params.items() if d is not inspect.Parameter.empty
    }


def test_llm_compressors_keywords_are_translated_once_and_unknown_ones_named() -> None:
    args = OneshotArgs.from_call({"model": "m"}, {"concatenate_data": True, "trust_remote_code_model": True})
    assert args.concatenate and args.trust_remote_code
    with pytest.raises(TypeError, match="no_such_keyword"):
        OneshotArgs.from_call({"model": "m"}, {"no_such_keyword": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.model = "other"  # type: ignore[misc]
