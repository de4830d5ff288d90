"""Checks shared by the recipe tests (test_recipe*.py): same modifiers, YAML round trip, a group's weights."""

from __future__ import annotations

from compressed_tensors.quantization import QuantizationArgs

from seqcal.modifiers import QuantizationModifier
from seqcal.recipe.parse import Recipe, parse_recipe


def assert_same(a: Recipe, b: Recipe) -> None:
    """Same modifier classes with the same arguments, in the same order."""
    assert [type(m) for m in a.modifiers] == [type(m) for m in b.modifiers]
    assert [m.to_dict() for m in a.modifiers] == [m.to_dict() for m in b.modifiers]


def round_trip(recipe: Recipe) -> None:
    """``to_yaml`` reads back to the same recipe."""
    assert_same(recipe, parse_recipe(recipe.to_yaml()))


def group_weights(modifier: QuantizationModifier, group: str = "group_0") -> QuantizationArgs:
    """The weight quantization arguments of one config group."""
    return modifier.groups[group].weights
