"""The model's processor (image processor, feature extractor, chat template) beside the checkpoint.

A processor object given to ``oneshot`` (``processor=``, llm-compressor's name for ``tokenizer``) is split
into its tokenizer, which batches text as any tokenizer does, and the processor, saved with the checkpoint.
For a model given as a directory, its processor files are copied into the checkpoint as they are, so
processors that need optional packages to load (transformers' torchvision-backed video processors) are kept
without loading them. Calibration rows with images are turned into inputs by ``load_processor``, which loads
such a processor without its video part where torchvision is missing (a CPU-only torch install).

Example:
    >>> tok, processor = split_processor(AutoProcessor.from_pretrained("llava-dir"))  # doctest: +SKIP
    >>> save_processor(processor, Path("llava-dir"), Path("out"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger("seqcal")

# Files of a processor besides the tokenizer's (transformers' names), copied from the model's directory.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)
# Attributes of a processor object that hold the part applied to images or audio.
_MEDIA_PARTS = ("image_processor", "feature_extractor", "video_processor", "audio_processor")


def split_processor(tokenizer: Any) -> tuple[Any, Any]:
    """(the tokenizer to batch text with, the processor to save or None) from a tokenizer or a processor.

    Example:
        >>> split_processor(tok)  # a plain tokenizer  # doctest: +SKIP
        (tok, None)
    """
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and any(getattr(tokenizer, part, None) is not None for part in _MEDIA_PARTS):
        return inner, tokenizer
    if hasattr(tokenizer, "model_input_names") and not hasattr(tokenizer, "encode") and inner is None:
        return None, tokenizer  # an image processor or feature extractor alone: no text side
    return tokenizer, None


def processor_source(model: Any, tokenizer: Any) -> Path | None:
    """The directory whose processor files go with the checkpoint: ``tokenizer`` when it names one, else the
    model's (for a Hub id, its local snapshot); None when neither is a directory.

    Args:
        model: the ``model`` argument (a directory, 'default', a Hub id or a loaded model).
        tokenizer: the ``tokenizer`` / ``processor`` argument.
    """
    for given in (tokenizer, model):
        if not isinstance(given, (str, Path)):
            continue
        if Path(given).is_dir():
            return Path(given)
        try:
            from seqcal.models import resolve_model

            path = Path(resolve_model(str(given)))
        except (OSError, ValueError):  # not found offline: no files to copy from it
            continue
        if path.is_dir():
            return path
    return None


def has_processor(processor: Any, source: Path | None) -> bool:
    """Whether a processor object is given or ``source`` holds a processor's files."""
    return processor is not None or (
        source is not None and any((source / f).is_file() for f in PROCESSOR_FILES)
    )


def load_processor(source: Path) -> Any:
    """The processor in ``source`` (``AutoProcessor``); without torchvision, the same class less its video part.

    Why by hand: transformers builds Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's processors with a video processor
    that only loads with torchvision, so ``AutoProcessor`` raises ImportError for them on a machine without it,
    although images need only the image processor (which has a PIL backend) and the tokenizer. Calibration
    rows carry no video, so the processor is built from those two parts; its class, chat template and the way
    it expands image tokens are transformers' own.

    Raises:
        ImportError: as ``AutoProcessor`` raises it, when the processor cannot be built without the package.
    """
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(source))
    except ImportError as exc:
        cls = _processor_class(source)
        if cls is None or "video_processor" not in cls.get_attributes():
            raise
        kept = [name for name in cls.get_attributes() if name != "video_processor"]
        without_video = type(cls.__name__, (cls,), {
            "get_attributes": classmethod(lambda _cls: list(kept)), "__module__": cls.__module__,
        })  # fmt: skip
        processor = without_video.from_pretrained(str(source))
        logger.info("seqcal: %s loaded without its video processor (%s); images and text only",
                    cls.__name__, str(exc).strip().split(". ")[0])  # fmt: skip
        return processor


def _processor_class(source: Path) -> Any:
    """The processor class ``source``'s files name (or its config's model type maps to), or None."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = None
    for file in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        if name is None and (source / file).is_file():
            name = json.loads((source / file).read_text(encoding="utf-8")).get("processor_class")
    if name is None and (source / "config.json").is_file():
        model_type = json.loads((source / "config.json").read_text(encoding="utf-8")).get("model_type")
        name = PROCESSOR_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if isinstance(name, str) else None


def save_processor(processor: Any, source: Path | None, output_dir: str | Path) -> list[str]:
    """Write the processor beside the checkpoint: ``processor.save_pretrained``, else copy ``source``'s files.

    Args:
        processor: a processor object (None: copy from ``source``).
        source: the directory the model (or its processor) came from, or None.
        output_dir: the checkpoint directory.

    Returns:
        The processor files now in ``output_dir`` (names).
    """
    out = Path(output_dir)
    if processor is not None:
        processor.save_pretrained(str(out))
    elif source is not None and source.resolve() != out.resolve():
        for name in PROCESSOR_FILES:
            if (source / name).is_file() and not (out / name).exists():
                shutil.copyfile(source / name, out / name)
    return [name for name in PROCESSOR_FILES if (out / name).is_file()]
