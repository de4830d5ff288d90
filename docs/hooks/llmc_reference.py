"""The table of llm-compressor ``oneshot`` keywords and what seqcal does with each, rendered when the site is built.

A page that holds the line ``<!-- seqcal-llmc-keywords -->`` gets, in its place, the tables of
``seqcal.recipe.llmc_compat`` (ALIASES, VALUE_ALIASES, RULES): read from the module, they cannot fall behind it.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- seqcal-llmc-keywords -->"


def _value(value: Any) -> str:
    return f"`{value!r}`".replace("|", "\\|")


def render() -> list[str]:
    """Markdown tables of the aliases, the value aliases and the rules."""
    from seqcal.recipe.llmc_compat import ALIASES, RULES, VALUE_ALIASES

    lines = ["| llm-compressor keyword | seqcal keyword |", "|---|---|"]
    lines += [f"| `{old}` | `{new}` |" for old, new in ALIASES.items()]
    lines += ["", "| keyword | llm-compressor value | seqcal value |", "|---|---|---|"]
    lines += [
        f"| `{k}` | {_value(a)} | {_value(b)} |"
        for k, table in VALUE_ALIASES.items()
        for a, b in table.items()
    ]
    lines += [
        "",
        "| keyword | accepted values | when accepted (logged) | otherwise refused |",
        "|---|---|---|---|",
    ]
    for name, rule in RULES.items():
        accepts = "every value" if rule.accepts is None else ", ".join(map(_value, rule.accepts)) or "none"
        lines.append(f"| `{name}` | {accepts} | {rule.note} | {rule.refusal} |")
    return lines


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Replace the marker with the tables."""
    return markdown.replace(MARKER, "\n".join(render())) if MARKER in markdown else markdown
