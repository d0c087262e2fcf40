"""How the Hub tests run aftgen as a user of a fake Hub would: their environment, and commands in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fake_hub import FakeHub

TOKEN = "hf_test_token"


def hub_env(hub: FakeHub, home: Path, **extra: str) -> dict[str, str]:
    """The environment of a user of `hub` whose Hugging Face cache is `home` (read at import: hence subprocesses)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_TOKEN=TOKEN, HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1",  # the fake Hub takes LFS uploads, not Xet
        NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",  # the fake Hub is local, whatever proxy is set
    )  # fmt: skip
    return env | extra


def aftgen(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aftgen", *args], capture_output=True, text=True, env=env, timeout=300)


# Runs commands one after another in one fresh interpreter, as a user would in one shell: importing torch
# costs seconds per process on a busy 2-core machine.
SESSION = """
import json, sys
from typer.testing import CliRunner
from aftgen.cli import app
done = [CliRunner().invoke(app, args) for args in json.loads(sys.argv[1])]
print(json.dumps([[r.exit_code, r.stdout, r.stderr] for r in done]))
"""


def aftgen_session(
    env: dict[str, str], *commands: list[str], python: str | Path = sys.executable
) -> list[subprocess.CompletedProcess]:
    ran = subprocess.run(
        [python, "-c", SESSION, json.dumps(commands)], capture_output=True, text=True, env=env, timeout=300
    )
    assert ran.returncode == 0, ran.stderr
    return [
        subprocess.CompletedProcess(args, *outcome)
        for args, outcome in zip(commands, json.loads(ran.stdout), strict=True)
    ]
