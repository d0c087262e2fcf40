from aftgen.cli import run

run()
