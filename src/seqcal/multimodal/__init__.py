"""Vision-language and speech models: the model class from the config, their inputs through calibration.

``classes`` picks the class a checkpoint loads with (image-text-to-text, speech-to-text, seq2seq, causal LM)
(the names its tensors are stored under: ``seqcal.mappings.names.checkpoint_names``); ``inputs`` turns rows mapped through a processor (pixel values,
image grids, audio features) into calibration batches that carry every input the model's forward takes.
"""

from seqcal.multimodal.classes import TASKS, model_class, model_task

__all__ = ["TASKS", "model_class", "model_task"]
