"""Corpora of any size: files and folders streamed into a tokenizer and memory-mapped token files.

Nothing holds a corpus in memory. A scan checks and hashes each file; the held-out split is planned
from the counts alone (split.py); the tokenizer trains on a bounded sample from across the training
split (sample.py); encoding streams through the text in chunks on every core (encode.py) into token
files that training memory-maps, cached by content and continued if a run is killed (cache.py).
"""

from aftgen.corpus.prepare import CorpusOptions, PreparedCorpus, prepare_corpus
from aftgen.corpus.sources import read_text

__all__ = ["CorpusOptions", "PreparedCorpus", "prepare_corpus", "read_text"]
