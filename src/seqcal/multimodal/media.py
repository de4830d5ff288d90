"""Images and audio named by calibration rows, loaded: files, URLs (fetched only when given), objects.

An image is a PIL image, a path (absolute, or relative to the rows' JSON lines file) or an http(s) URL; it is
converted to RGB. Audio is an array of samples, a ``{"array": ..., "sampling_rate": ...}`` dict (a
``datasets`` Audio value), a WAV file (read with the standard library) or another file transformers can read;
it is mixed down to mono and resampled (linear interpolation) to the processor's sampling rate.

Example:
    >>> loaded = Loaded("rows.jsonl:3", Path("/data"), None)
    >>> loaded.add("image", "cat.png", "a 'image' item")  # doctest: +SKIP
"""

from __future__ import annotations

import wave
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from seqcal.data.args import CalibrationDataError

_URL_PREFIXES = ("http://", "https://")


class Loaded:
    """The media of one row, loaded in order (``images``, ``audios``); errors name ``where``.

    Args:
        where: the row's place (``file:line``).
        base: the folder relative paths are read from, None: the working folder.
        rate: the processor's audio sampling rate (None: the model takes no audio).
    """

    def __init__(self, where: str, base: Path | None, rate: int | None) -> None:
        self.where, self.base, self.rate = where, base, rate
        self.images: list[Any] = []
        self.audios: list[np.ndarray] = []

    def add(self, kind: str, value: Any, what: str) -> None:
        """Load ``value`` as an image or audio (``kind``) of the row; ``what`` names where it was found."""
        if kind == "image":
            self.images.append(load_image(value, self.where, self.base, what))
            return
        if self.rate is None:
            raise CalibrationDataError(f"{self.where}: {what} holds audio, but the model's processor takes no "
                                       "audio (no feature extractor); remove it or calibrate a speech model")  # fmt: skip
        self.audios.append(load_audio(value, self.where, self.base, self.rate, what))


def _path(value: str | Path, where: str, base: Path | None, what: str) -> Path:
    path = Path(value).expanduser()
    full = path if path.is_absolute() or base is None else base / path
    if not full.is_file():
        relative = (
            f" (relative paths are read from {base})" if base is not None and not path.is_absolute() else ""
        )
        raise CalibrationDataError(f"{where}: {what} names the file {str(value)!r}, which does not exist"
                                   f"{relative}; fix the path or remove the row")  # fmt: skip
    return full


def load_image(value: Any, where: str, base: Path | None, what: str) -> Any:
    """A PIL image in RGB from a PIL image, a path or a URL.

    Raises:
        CalibrationDataError: a missing file, a file PIL cannot read, or a value of another type.
    """
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, str) and value.startswith(_URL_PREFIXES):
        from transformers.image_utils import load_image as fetch

        try:
            return fetch(value).convert("RGB")
        except Exception as err:  # requests' and PIL's errors: one message naming the URL
            raise CalibrationDataError(f"{where}: {what} could not be fetched from {value!r} ({err}); check the "
                                       "URL and the network, or give a local file") from err  # fmt: skip
    if not isinstance(value, (str, Path)):
        raise CalibrationDataError(f"{where}: {what} is a {type(value).__name__}; give a PIL image, a file path "
                                   "or an http(s) URL")  # fmt: skip
    path = _path(value, where, base, what)
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except OSError as err:
        raise CalibrationDataError(f"{where}: {what} names {str(path)!r}, which is not an image PIL can read "
                                   f"({err}); give a PNG or JPEG file") from err  # fmt: skip


def load_audio(value: Any, where: str, base: Path | None, rate: int, what: str) -> np.ndarray:
    """Mono float32 samples at ``rate`` from an array, a ``{"array", "sampling_rate"}`` dict or a file.

    Raises:
        CalibrationDataError: a missing or unreadable file, or a value of another type.
    """
    source_rate = rate
    if isinstance(value, Mapping) and "array" in value:
        value, source_rate = value["array"], int(value.get("sampling_rate") or rate)
    if isinstance(value, (str, Path)):
        value, source_rate = _read_audio(value, where, base, rate, what)
    try:
        samples = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as err:
        raise CalibrationDataError(f"{where}: {what} is not audio samples ({err}); give an array of floats, a "
                                   "WAV file or {'array': ..., 'sampling_rate': ...}") from err  # fmt: skip
    if samples.ndim == 2:  # [channels, samples] or [samples, channels]: mixed down
        samples = samples.mean(axis=0 if samples.shape[0] < samples.shape[1] else 1)
    if samples.ndim != 1 or samples.size == 0:
        raise CalibrationDataError(f"{where}: {what} has shape {list(samples.shape)}; give one channel of "
                                   "samples (1-D) or [channels, samples]")  # fmt: skip
    return _resampled(samples, source_rate, rate)


def _read_audio(value: str | Path, where: str, base: Path | None, rate: int, what: str) -> tuple[Any, int]:
    """(samples, their sampling rate) of a file: WAV by the standard library, else transformers' reader."""
    if str(value).startswith(_URL_PREFIXES):
        path: Any = str(value)
    else:
        path = _path(value, where, base, what)
        if path.suffix.lower() == ".wav":
            return _read_wav(path, where, what)
    from transformers.audio_utils import load_audio as read

    try:
        return read(str(path), sampling_rate=rate), rate
    except Exception as err:  # its backends' (librosa, soundfile, requests) errors: one message
        raise CalibrationDataError(f"{where}: {what} {str(value)!r} could not be read ({err}); give a WAV file "
                                   "or the samples as an array") from err  # fmt: skip


def _read_wav(path: Path, where: str, what: str) -> tuple[np.ndarray, int]:
    try:
        with wave.open(str(path), "rb") as f:
            width, channels, rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
            raw = f.readframes(f.getnframes())
    except (wave.Error, EOFError) as err:
        raise CalibrationDataError(f"{where}: {what} names {str(path)!r}, which is not a PCM WAV file ({err}); "
                                   "convert it to 16-bit PCM WAV or give the samples as an array") from err  # fmt: skip
    if width == 1:
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        kind = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(raw, kind).astype(np.float32) / float(np.iinfo(kind).max)
    else:
        raise CalibrationDataError(f"{where}: {what} names {str(path)!r}, a WAV file of {8 * width}-bit samples; "
                                   "convert it to 16-bit PCM WAV")  # fmt: skip
    return samples.reshape(-1, channels).T, rate


def _resampled(samples: np.ndarray, source: int, target: int) -> np.ndarray:
    if source == target:
        return samples
    n = max(1, round(len(samples) * target / source))
    return np.interp(np.linspace(0, len(samples) - 1, n), np.arange(len(samples)), samples).astype(np.float32)
