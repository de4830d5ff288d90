"""The ``seqcal`` command line: ``seqcal trace | oneshot | plan | eval | model-free``.

Every subcommand takes ``-v`` (debug lines; a traceback on errors) and ``-q`` (errors only). A user error
prints ``seqcal: error: <what, where, fix>`` and exits with 2; a bug says so in one line and exits with 3.
Each subcommand's options and what it runs are in a module of its own (``trace.py``, ``oneshot.py``,
``evaluate.py``, ``plan.py``, ``model_free.py``); this one builds the parser and runs a command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from seqcal.backend.host import limit_onednn_cache, map_large_allocations
from seqcal.backend.threads import choose_threads
from seqcal.cli.evaluate import add_eval
from seqcal.cli.model_free import add_model_free
from seqcal.cli.oneshot import add_oneshot
from seqcal.cli.oneshot import cmd_oneshot as cmd_oneshot  # re-exported: each command beside its options
from seqcal.cli.plan import add_plan
from seqcal.cli.plan import cmd_plan as cmd_plan
from seqcal.cli.trace import add_trace, format_of
from seqcal.console import EXIT_INTERRUPTED, SeqcalParser, console_logging, report_error
from seqcal.report import FORMATS

_DESCRIPTION = """Quantize a Hugging Face model after training, one subgraph at a time (llm-compressor's recipes).

Every command takes -v (debug lines; a traceback on errors) and -q (errors only). A user error prints
`seqcal: error: <what, where, fix>` and exits with 2; a bug says so in one line and exits with 3."""
_EPILOG = """`seqcal COMMAND --help` lists a command's options. For example:
  seqcal oneshot --model default --recipe recipes/gptq_w4a16.yaml --output-dir out
  seqcal eval ppl --model out"""


def build_parser() -> argparse.ArgumentParser:
    parser = SeqcalParser(
        prog="seqcal",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(verbose=0, quiet=False)
    # not required: `seqcal` alone prints this help (main), not argparse's "arguments are required: command"
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    add_trace(sub)
    add_oneshot(sub)
    add_eval(sub)
    add_plan(sub)
    add_model_free(sub)
    return parser


def _user_modifier_logger(name: str) -> bool:
    """``recipe.imports.user_modifier_logger``, imported when the first record is logged, not at start-up (the
    command's help and usage errors import no torch)."""
    from seqcal.recipe.imports import user_modifier_logger

    return user_modifier_logger(name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``seqcal`` command."""
    limit_onednn_cache()  # first: oneDNN reads the setting when it creates its first primitive
    map_large_allocations()  # before the run allocates: the threshold applies to blocks allocated after it
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `seqcal` alone: what it can do, on stderr, with argparse's usage-error status
        parser.print_help(sys.stderr)
        return 2
    if args.command == "trace" and (args.format or args.output):
        if not args.output:
            parser.error("trace: --format needs --output FILE")
        if not args.format and format_of(args.output) not in FORMATS:
            parser.error(
                f"trace: give --format {{{','.join(sorted(FORMATS))}}} or an --output with that suffix"
            )
    try:
        with console_logging(args.verbose, args.quiet, shown=_user_modifier_logger):
            choose_threads(getattr(args, "threads", None))  # process-wide: the cores others leave free
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("seqcal: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every failure ends as one line (a traceback with -v)
        return report_error(exc, args.verbose)
