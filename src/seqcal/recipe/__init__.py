"""Recipes: YAML (seqcal's and llm-compressor's formats) <-> modifiers."""

from seqcal.recipe.parse import Recipe, parse_recipe

__all__ = ["Recipe", "parse_recipe"]
