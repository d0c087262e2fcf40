"""Training a model on a corpus: options (options.py), the loop (loop.py), the run folder (run_folder.py)."""

from aftgen.training.loop import TrainingInterrupted, train
from aftgen.training.options import TrainOptions, parse_duration

__all__ = ["TrainOptions", "TrainingInterrupted", "parse_duration", "train"]
