"""The run folder (aftgen/training/run_folder.py): claimed by one run, refused when it holds another or has
nothing to resume, and the checks it records and the best among them."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def test_run_folder_alone_refuses_mistakes_and_keeps_the_best_check(tmp_path, corpus, tiny_run):
    from aftgen.distributed import World
    from aftgen.errors import AftgenError
    from aftgen.model import AFTConfig
    from aftgen.training.loop import Clock
    from aftgen.training.options import TrainOptions
    from aftgen.training.plan import Plan
    from aftgen.training.run_folder import RunFolder, claimed

    with (
        pytest.raises(AftgenError, match="already holds a run"),
        claimed(TrainOptions(corpus, tiny_run), World(), print),
    ):
        pass
    with pytest.raises(AftgenError, match="no training state to resume"):
        with claimed(TrainOptions(corpus, tmp_path / "new", resume=True), World(), print):
            pass
    plan = Plan(TrainOptions(corpus, tmp_path / "new", keep_best=True), AFTConfig.from_preset("tiny", 300), 8, {})
    run = RunFolder(plan, World(), description={})
    checks = [
        run.record({"step": step, "held_out_nats_per_char": score}) for step, score in ((2, 3.0), (4, 2.0), (6, 2.5))
    ]
    assert checks == [True, True, False] and run.best == {"step": 4, "held_out_nats_per_char": 2.0}
    assert [json.loads(line)["step"] for line in (run.path / "metrics.jsonl").read_text().splitlines()] == [2, 4, 6]

    clock = Clock(TrainOptions(corpus, max_steps=100, max_time=10), elapsed_before=0)
    assert clock.progress(step=10, elapsed=5.0) == 0.5  # the clock runs out first
    assert clock.progress(step=80, elapsed=5.0) == 0.8  # the steps do
