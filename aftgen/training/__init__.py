"""Training a model on a corpus: its options (options.py), settled once into a plan (plan.py), the loop
(loop.py: `train`), the run folder (run_folder.py) and its training state file (state_file.py); the run's
record is aftgen/record.py.

Import from the modules themselves: this package runs nothing, so that each part comes without the whole
training loop.
"""
