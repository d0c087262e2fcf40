"""Text out of a generation: stop strings cut it, even split across pieces, and only whole characters go out."""

from __future__ import annotations

import subprocess
import sys

from conftest import DEVICE

from aftgen.generation.stream import StopFilter


def test_stop_filter_cuts_a_stop_string_split_across_pieces():
    stops = StopFilter(("STOP",))
    out = "".join(stops.feed(piece) for piece in ["ab", "c S", "T", "O", "P and more"])
    assert out == "abc " and stops.stopped
    partial = StopFilter(("STOP",))
    assert partial.feed("xx ST") == "xx " and partial.flush() == "ST"  # held back, then given up at the end


def test_streaming_holds_byte_pieces_until_a_character_is_whole(tiny):
    _, tokenizer = tiny
    text = "na\u00efve \u65e5\u672c \U0001f600 \ue000s end"  # none of these is in the training corpus
    decoder = tokenizer.stream_decoder()
    pieces = [decoder.feed(token) for token in tokenizer.encode(text)] + [decoder.flush()]
    assert "".join(pieces) == text
    assert "" in pieces[:-1] and all("\ufffd" not in piece for piece in pieces)


def test_cli_stream_through_a_pipe_is_valid_utf8(tiny_run):
    done = subprocess.run(
        [sys.executable, "-m", "aftgen", "sample", "--model", str(tiny_run), "--device", DEVICE,
         "-p", "\U0001f600 \u65e5", "-n", "60", "--temperature", "2", "--seed", "1"],
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode("utf-8").startswith("\U0001f600 \u65e5")  # strict: raises on a broken character
