"""What the ``seqcal`` command prints besides its results: log lines and errors, on stderr.

Levels: the default shows warnings and one INFO line per decision the run makes (how the graph is cut,
fallbacks, finer targets); ``-q`` shows errors only; ``-v`` shows debug lines and, on an error, the traceback.
The same levels hold for the loggers of modifiers written outside seqcal (named in a recipe by import path or
entry point): ``logging.getLogger(__name__)`` in their package prints beside seqcal's own lines.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from seqcal.errors import is_user_error, one_line

# Messages written for library users often start with "seqcal: " or their module ("seqcal.x.y: ");
# the console prefixes every line itself.
_OWN_PREFIX = re.compile(r"^seqcal(\.[\w.]+)?: ")
EXIT_USER_ERROR = 2
EXIT_BUG = 3
EXIT_INTERRUPTED = 130


class ConsoleFormatter(logging.Formatter):
    """``seqcal: <message>``, ``seqcal: warning: <message>``; the logger name only with ``-v``."""

    def __init__(self, verbose: bool = False) -> None:
        super().__init__()
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        message = _OWN_PREFIX.sub("", record.getMessage())
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        origin = f"[{record.name}] " if self.verbose else ""
        text = f"seqcal: {level}{origin}{message}"
        if record.exc_info and self.verbose:
            text += "\n" + self.formatException(record.exc_info)
        return text


@contextlib.contextmanager
def console_logging(
    verbose: int = 0,
    quiet: bool = False,
    stream: TextIO | None = None,
    shown: Callable[[str], bool] | None = None,
) -> Iterator[None]:
    """Within the block, the ``seqcal`` loggers, and the other loggers ``shown`` accepts, write to stderr at the
    level the flags ask for.

    A logger ``shown`` accepts (the command line passes ``recipe.imports.user_modifier_logger``: a user modifier's
    ``logging.getLogger(__name__)``) is reached through the root logger, whose level is set to the same; records
    of other libraries are not shown (their warnings
    are, as Python shows them without any handler, when the host configured none). The loggers' handlers, levels
    and propagation are restored on the way out, so ``main()`` called from Python (tests, notebooks) leaves the
    host's logging as it found it.

    Args:
        verbose: ``-v`` count: 1 or more shows DEBUG lines.
        quiet: ``-q``: errors only.
        stream: where to write (default: sys.stderr at call time).
        shown: which other loggers, by name, print as seqcal's own (None: none, and the root logger is left
            alone).

    Example:
        >>> with console_logging(verbose=1):  # doctest: +SKIP
        ...     oneshot(...)
    """
    logger, root = logging.getLogger("seqcal"), logging.getLogger()
    level = logging.ERROR if quiet else logging.DEBUG if verbose else logging.INFO
    saved = logger.level, logger.propagate, root.level
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(ConsoleFormatter(verbose > 0))
    handlers = [(logger, handler)] + (
        _root_handlers(root, shown, stream, verbose) if shown is not None else []
    )
    for owner, h in handlers:
        owner.addHandler(h)
    logger.setLevel(level)
    if shown is not None:
        root.setLevel(level)
    logger.propagate = False  # a root handler configured by the host would print every line twice
    try:
        with _quiet_transformers() if quiet else contextlib.nullcontext():
            yield
    finally:
        for owner, h in handlers:
            owner.removeHandler(h)
        logger.level, logger.propagate, root.level = saved


def _root_handlers(
    root: logging.Logger, shown: Callable[[str], bool], stream: TextIO | None, verbose: int
) -> list[tuple[logging.Logger, logging.Handler]]:
    """The root logger's handlers for the loggers ``shown`` accepts (any name: they reach the root logger), at the
    console's level, and for the others' warnings where the host configured no handler."""
    users = logging.StreamHandler(stream or sys.stderr)
    users.setFormatter(ConsoleFormatter(verbose > 0))
    users.addFilter(lambda record: shown(record.name))
    if root.handlers:
        return [(root, users)]
    # Python prints the warnings of a process without any handler by itself (logging.lastResort); with ours on
    # the root logger it would not, so the others' warnings keep a handler of their own, as plain as lastResort's
    others = logging.StreamHandler(stream or sys.stderr)
    others.setLevel(logging.WARNING)
    others.addFilter(lambda record: not shown(record.name))
    return [(root, users), (root, others)]


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' own warnings and progress bars (loading weights) off within the block, for ``-q``."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def report_error(exc: BaseException, verbose: int = 0, stream: TextIO | None = None) -> int:
    """Print ``exc`` for a person (traceback only with ``-v``) and return the command's exit status.

    A user error (``seqcal.errors.is_user_error``) prints ``seqcal: error: <message>`` and returns 2; any
    other exception is a bug: one line saying so, and 3.

    Example:
        >>> report_error(FileNotFoundError("recipe.yaml: not found"))  # doctest: +SKIP
        2
    """
    out = stream or sys.stderr
    if verbose:
        traceback.print_exception(exc, file=out)
    if is_user_error(exc):
        print(f"seqcal: error: {_message(exc)}", file=out)
        return EXIT_USER_ERROR
    hint = "the traceback is above" if verbose else "rerun with -v for the traceback"
    print(
        f"seqcal: error: internal error (a bug in seqcal, please report it with the command): "
        f"{type(exc).__name__}: {one_line(exc).splitlines()[0][:300]}; {hint}",
        file=out,
    )
    return EXIT_BUG


def _message(exc: BaseException) -> str:
    """The user error's text; an OSError from the system (errno set) as ``<file>: <reason>``."""
    if isinstance(exc, OSError) and exc.errno is not None and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror}"
    return one_line(exc)


class SeqcalParser(argparse.ArgumentParser):
    """An argparse parser whose errors read like seqcal's, and where every (sub)command takes -v and -q."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # SUPPRESS: a subcommand sets them only when given, so `seqcal -v oneshot` keeps the top-level -v
        self.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                          help="show debug lines, and the traceback of an error")  # fmt: skip
        self.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                          help="show errors only (no warnings, decisions or progress bars)")  # fmt: skip

    def error(self, message: str) -> Any:
        where = self.prog.removeprefix("seqcal").strip()
        print(
            f"seqcal: error: {where + ': ' if where else ''}{message}; see `{self.prog} --help`",
            file=sys.stderr,
        )
        raise SystemExit(2)
