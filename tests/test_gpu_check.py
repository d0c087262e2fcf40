"""scripts/gpu_check.py end to end on the CPU at its quick sizes: every stage runs and reports, so the
check prepared for a GPU machine cannot rot where no GPU is."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aftgen.model import ACTIVATIONS

SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_check.py"
STAGES = [
    "environment",
    "parity",
    "suite",
    "train_bf16",
    "bench_train",
    "kernel",
    "bench_generate",
    "bench_serve",
    "train_compile",
]


@pytest.mark.cpu  # the GPU's own run is the script itself; inside it, this test would run the script again
def test_the_check_runs_every_stage_on_the_cpu_and_reports_each(tmp_path, corpus):
    out = tmp_path / "check"
    command = [sys.executable, str(SCRIPT), str(out), "--device", "cpu", "--quick", "--eager", "--corpus", str(corpus)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    stages = {stage["name"]: stage for stage in results["stages"]}
    assert list(stages) == STAGES and results["passed"] and results["device"] == "cpu"
    suite = stages["suite"]["figures"]  # the model test, once per activation
    assert suite["passed"] == len(ACTIVATIONS) and suite["failed"] == 0
    assert stages["parity"]["figures"]["fp32_max_diff"] < 1e-3
    kernel = stages["kernel"]["figures"]  # the fused kernels, in Triton's interpreter here
    assert kernel["ok"] and [row["length"] for row in kernel["rows"]] == [64]
    for run in ("train_bf16", "train_compile"):
        assert stages[run]["figures"]["steps"] > 0 and stages[run]["figures"]["nats_per_char"] > 0
        assert stages[run]["figures"]["device"] == "cpu bf16"
    measures = {row["measure"] for name in ("bench_train", "bench_generate", "bench_serve")
                for row in stages[name]["figures"]["rows"]}  # fmt: skip
    assert {"train step", "step latency", "aggregate throughput"} <= measures
    report = (out / "report.txt").read_text()
    assert report.startswith(f"aftgen gpu-check on cpu (quick sizes): {len(STAGES)}/{len(STAGES)} stages passed")
    assert all(f"{name} " in report for name in STAGES)
    headers = re.findall(r"^===== (\S+)$", (out / "log.txt").read_text(), re.MULTILINE)
    assert headers == STAGES


def test_a_failing_stage_is_recorded_and_the_later_ones_still_run(tmp_path):
    out = tmp_path / "check"
    command = [sys.executable, str(SCRIPT), str(out), "--device", "tpu", "--only", "parity,bench_serve"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    stages = json.loads((out / "results.json").read_text())["stages"]
    assert [stage["name"] for stage in stages] == ["environment", "parity", "bench_serve"]
    assert all(stage["ok"] is False and stage["error"] for stage in stages[1:])
    assert "unknown --device 'tpu'" in stages[2]["error"]
    assert "FAILED" in (out / "report.txt").read_text()
