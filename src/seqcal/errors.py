"""The one base class of seqcal's user errors, and how the command line tells them from bugs.

A user error is something the person running seqcal can fix (a recipe, a path, an argument, the data, the
model): its message says what is wrong, where, and the fix. Everything else is a bug in seqcal or a library.
"""

from __future__ import annotations

# Exceptions that argument checks and file loading raise with a message meant for the user, besides
# SeqcalError: checks of argument values (ValueError, TypeError), files that are missing or unreadable
# (OSError: FileNotFoundError, PermissionError, NotADirectoryError, FileExistsError, ...).
USER_ERROR_TYPES: tuple[type[BaseException], ...] = (ValueError, TypeError, OSError)


class SeqcalError(Exception):
    """Base of seqcal's own errors: the message is meant for the user and names the fix.

    The specific classes (``TracingError``, ``RecipeError``, ``CalibrationDataError``, ``ResumeError``,
    ``DiskSpaceError``, ``EmbeddedModelMissingError``, ``UsageError``) also derive from the built-in
    exception their callers have always caught (RuntimeError, ValueError, OSError, ImportError).
    """


class UsageError(SeqcalError, ValueError):
    """Command-line arguments that do not fit together; the message names the option to add or drop."""


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's to fix (report its message) rather than a bug (report a traceback).

    Args:
        exc: the exception that ended the command.

    Returns:
        True for SeqcalError and ``USER_ERROR_TYPES``, False for anything else.

    Example:
        >>> is_user_error(FileNotFoundError("model.safetensors")), is_user_error(KeyError("x"))
        (True, False)
    """
    return isinstance(exc, (SeqcalError, *USER_ERROR_TYPES))


def one_line(exc: BaseException) -> str:
    """The exception's message for ``seqcal: error: ...``: its text, or its type when it has none."""
    text = str(exc).strip()
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        text = str(exc.args[0])
    return text or type(exc).__name__


class ModelLoadError(SeqcalError, OSError):
    """transformers cannot build or read the model in a checkpoint directory."""

    @classmethod
    def wrap(cls, source: object, exc: BaseException) -> ModelLoadError:
        """The error for ``exc`` raised while loading ``source``: what failed, where, and what to check (an
        error of this kind already says all of it and is returned as it is)."""
        if isinstance(exc, cls):
            return exc
        what = one_line(exc).splitlines()[0][:300]
        return cls(
            f"{source}: cannot load the model ({type(exc).__name__}: {what}); check that the directory is a "
            "complete transformers checkpoint (config.json and its *.safetensors weights) of a supported "
            "architecture"
        )
