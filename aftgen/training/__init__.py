"""Training a model on a corpus: options (options.py), the loop (loop.py: `train`), the run folder
(run_folder.py) and its files (state_file.py, record.py).

Import from the modules themselves: this package runs nothing, so that its parts (the run's record, which
model cards and `aftgen plot` read) come without the whole training loop.
"""
