from aftgen.cli import app

app(prog_name="aftgen")
