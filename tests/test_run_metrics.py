"""The run's figures as JSON lines in the state dir and as TensorBoard scalars (scheduler/metrics.py), and the one
line `--tensorboard` says without the package."""

from __future__ import annotations

import json

import pytest

from geotrain.cli import EXIT_USAGE, main
from geotrain.scheduler.calibration import StepTimings
from geotrain.scheduler.metrics import RunMetrics, node_shares, tensorboard_writer
from geotrain.scheduler.state import StepRecord

pytestmark = pytest.mark.timeout(60)


def _step(step: int, val_loss: float | None = None) -> StepRecord:
    return StepRecord(step=step, loss=4.0 - step, val_loss=val_loss, tokens_per_s=1000.0, seconds=0.5, plan_epoch=2)


# Two stages, the first with two replicas: a and b each computed 2 of the 4 microbatches, c all 4.
TIMINGS = StepTimings(plan_epoch=2, commit_s=0.05, compute_s={"a": 0.05, "b": 0.05, "c": 0.1},
                      forward_s={"a": 0.02, "b": 0.02, "c": 0.04}, averaging_s={"a": 0.1, "b": 0.1, "c": 0.0})
THROUGH = {"a": 2, "b": 2, "c": 4}


def test_each_node_splits_the_step_into_forward_backward_averaging_and_idle():
    shares = node_shares(0.5, TIMINGS, THROUGH)
    assert shares["a"] == pytest.approx({"forward": 0.08, "backward": 0.12, "averaging": 0.2, "idle": 0.6})
    assert shares["c"] == pytest.approx({"forward": 0.32, "backward": 0.48, "averaging": 0.0, "idle": 0.2})
    assert node_shares(0.5, None, THROUGH) == {}  # a step completed after a restart measured nothing


def test_steps_and_failures_go_to_json_lines_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = RunMetrics(tmp_path / "metrics.jsonl", tensorboard_writer(str(tmp_path / "tb")))
    links = {("a", "c"): 1000, ("c", "a"): 800}
    metrics.step(_step(0), TIMINGS, THROUGH, links, None)
    metrics.failure(1, "node b is gone")
    metrics.step(_step(1, val_loss=2.5), TIMINGS, THROUGH, links, 3.6)
    metrics.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["kind"], line["step"]) for line in lines] == [("step", 1), ("failure", 1), ("step", 2)]
    first, failure, last = lines
    assert first["loss"] == 4.0 and first["tokens_per_s"] == 1000.0 and first["step_s"] == 0.5
    assert first["nodes"]["c"] == pytest.approx({"forward": 0.32, "backward": 0.48, "averaging": 0.0, "idle": 0.2})
    assert first["link_bytes"] == {"a->c": 1000, "c->a": 800}
    assert failure["why"] == "node b is gone" and last["failures"] == 1
    assert last["val_loss"] == 2.5 and last["val_bits_per_byte"] == 3.6
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for tag in ("train/loss", "validation/loss", "speed/tokens_per_s", "speed/step_s", "run/failures",
                "node/a/forward_share", "node/a/backward_share", "node/a/averaging_share", "node/a/idle_share",
                "link/a->c/wire_bytes"):
        assert tag in scalars, (tag, scalars)
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 4.0), (2, 3.0)]
    assert [(e.step, e.value) for e in events.Scalars("validation/loss")] == [(2, 2.5)]


def test_tensorboard_without_the_package_is_one_line(capsys, monkeypatch, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))
    code = main(["coordinator", "--token", "t", "--listen", "127.0.0.1:0", "--tensorboard", str(tmp_path)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == EXIT_USAGE and lines == [
        "geotrain: error: --tensorboard needs the tensorboard package: pip install 'geotrain[tensorboard]'"
    ]
