"""Hugging Face Hub names -> local snapshot directories, resolved the way transformers and datasets do.

A name such as ``"org/name"`` is looked up with ``huggingface_hub.snapshot_download``: online it downloads
what is missing into the Hub cache (``HF_HUB_CACHE``, ``HF_HOME/hub`` or ``~/.cache/huggingface/hub``); with
``HF_HUB_OFFLINE=1``, or when the Hub cannot be reached, it returns the cached snapshot. Only the files seqcal
reads are fetched (``MODEL_FILES``): config, tokenizer, safetensors weights and their index, never ``.bin``
or ``.pt`` pickles, so a model is not downloaded twice in two formats and nothing untrusted is loaded.
Authentication (``HF_TOKEN``, ``hf auth login``) is huggingface_hub's own.

Example:
    >>> snapshot("HuggingFaceTB/SmolLM2-135M-Instruct", allow_patterns=MODEL_FILES)  # doctest: +SKIP
    PosixPath('/root/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/...')
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# Config and generation config (*.json also covers tokenizer.json and the safetensors index), sentencepiece
# and tiktoken vocabularies, BPE merges (*.txt), chat templates, and the weights in safetensors only.
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")
# Modeling code of a repository that needs trust_remote_code: fetched only when the user allows running it.
REMOTE_CODE_FILES = ("*.py",)


class HubError(ValueError):
    """A Hub name could not be resolved to a local snapshot; the message says why and what to do.

    ``reason`` is the message without its subject ("model 'org/name'"), for callers that name it themselves;
    ``offline`` is True when the Hub was not consulted (HF_HUB_OFFLINE=1) or could not be reached.
    """

    def __init__(self, subject: str, reason: str, offline: bool = False) -> None:
        super().__init__(f"{subject} {reason}")
        self.reason = reason
        self.offline = offline


def is_repo_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hub repository id (``"name"`` or ``"org/name"``).

    Example:
        >>> is_repo_id("org/name"), is_repo_id("./out"), is_repo_id("a/b/c")
        (True, False, False)
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_offline() -> bool:
    """Whether huggingface_hub runs offline (``HF_HUB_OFFLINE``, which it reads when it is imported)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cache() -> str:
    """The Hub cache folder huggingface_hub uses (``HF_HUB_CACHE``, ``HF_HOME/hub`` or the default)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def snapshot(
    repo_id: str,
    *,
    repo_type: str = "model",
    revision: str | None = None,
    allow_patterns: Sequence[str] | None = None,
) -> Path:
    """The local snapshot directory of a Hub repository: downloaded when online, read from the cache offline.

    Args:
        repo_id: ``"org/name"`` (or a legacy ``"name"``).
        repo_type: ``"model"`` or ``"dataset"``.
        revision: branch, tag or commit; None is ``"main"``.
        allow_patterns: glob patterns of the files to fetch (None: all files).

    Returns:
        The snapshot directory inside the Hub cache.

    Raises:
        HubError: not in the cache while offline, no such repository or revision, or a gated repository;
            the message names the repository and the fix.

    Example:
        >>> snapshot("org/calib", repo_type="dataset").name  # doctest: +SKIP
        '3f1c...'
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{'dataset' if repo_type == 'dataset' else 'model'} {repo_id!r}"
    at = f" at revision {revision!r}" if revision else ""
    page = f"https://huggingface.co/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
    try:
        path = snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, allow_patterns=list(allow_patterns or []) or None
        )
    except GatedRepoError as err:  # before RepositoryNotFoundError, its base class
        raise HubError(what, f"is gated on the Hugging Face Hub: accept its terms at {page} and log in "
                       "(`hf auth login` or HF_TOKEN)") from err  # fmt: skip
    except RevisionNotFoundError as err:
        raise HubError(what, f"has no revision {revision!r} on the Hugging Face Hub; pass an existing "
                       "branch, tag or commit") from err  # fmt: skip
    except RepositoryNotFoundError as err:
        raise HubError(what, "is not a repository on the Hugging Face Hub (a private "
                       "one needs `hf auth login` or HF_TOKEN); check the name or pass a local path") from err  # fmt: skip
    except LocalEntryNotFoundError as err:
        why = "while HF_HUB_OFFLINE=1" if hub_offline() else "and the Hub could not be reached"
        raise HubError(what, f"is not in the Hugging Face Hub cache ({hub_cache()}){at} "
                       f"{why}; run once online (or `hf download {repo_id}"
                       f"{' --repo-type dataset' if repo_type == 'dataset' else ''}`) to cache it, "
                       "or pass a local path", offline=True) from err  # fmt: skip
    return Path(path)
