"""Calibration data: any accepted source -> padded token batches (see ``seqcal.data.batches``)."""

from seqcal.data.args import ACCEPTED, CalibrationDataError, DataArgs
from seqcal.data.batches import load_calibration_batches
from seqcal.data.sources import default_calibration_text

__all__ = [
    "ACCEPTED",
    "CalibrationDataError",
    "DataArgs",
    "default_calibration_text",
    "load_calibration_batches",
]
