"""Benchmarks, measured on the machine at hand: `aftgen bench` (every mixer side by side, mixers.py)
and `aftgen bench generate` (the recurrent decoder, generate.py). Targets live in targets.py."""
