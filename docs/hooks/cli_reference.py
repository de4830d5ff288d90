"""The command-line reference, rendered from the ``seqcal`` parsers when the site is built.

A page that holds the line ``<!-- seqcal-cli -->`` gets, in its place, every subcommand of
``seqcal.cli.build_parser()`` (nested ones such as ``eval ppl`` included): its help, its usage line and a
table of its arguments with their defaults and help. Built from the parser itself, the page cannot fall behind
the command.
"""

from __future__ import annotations

import argparse

MARKER = "<!-- seqcal-cli -->"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.nargs == 0:  # a flag (store_true/false, count): not given unless typed
        return "off"
    if action.default in (None, argparse.SUPPRESS) or action.required:
        return "required" if action.required else ""
    if isinstance(action.default, list | tuple):
        return "`" + " ".join(map(str, action.default)) + "`"
    return f"`{action.default}`"


def _name(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    formatter = parser._get_formatter()
    return ", ".join(f"`{s}`" for s in action.option_strings) + (
        f" `{formatter._format_args(action, action.dest.upper())}`" if action.nargs != 0 else ""
    )


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    text = parser._get_formatter()._expand_help(action)
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        text += f" (one of: {', '.join(map(str, action.choices))})"
    return _cell(text)


def _table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if (
            isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
            or action.help == argparse.SUPPRESS
        ):
            continue
        rows.append(f"| {_name(parser, action)} | {_default(action)} | {_help(parser, action)} |")
    return rows if len(rows) > 2 else []


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return found


def render(parser: argparse.ArgumentParser, path: str = "seqcal", level: int = 2) -> list[str]:
    """Markdown for every subcommand under ``parser``, depth first."""
    lines: list[str] = []
    for name, summary, sub in _subcommands(parser):
        command = f"{path} {name}"
        lines += [f"{'#' * level} `{command}`", ""]
        if summary:
            lines += [_cell(summary)[:1].upper() + _cell(summary)[1:] + ".", ""]
        if sub.description and sub.description != summary:
            lines += [sub.description.strip(), ""]
        usage = " ".join(sub.format_usage().removeprefix("usage:").split())
        lines += ["```text", usage, "```", ""]
        table = _table(sub)
        lines += [*table, ""] if table else []
        lines += render(sub, command, level + 1)
    return lines


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Replace the marker with the reference, built from ``seqcal.cli.build_parser()`` now."""
    if MARKER not in markdown:
        return markdown
    from seqcal.cli import build_parser

    parser = build_parser()
    return markdown.replace(MARKER, "\n".join([parser.description or "", "", *render(parser)]))
