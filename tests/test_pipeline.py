"""End to end: a pipeline of real node processes over gRPC equals training in one process."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from geotrain.config import load_config
from geotrain.localnodes import process_name
from geotrain.node.data import Corpus
from geotrain.node.model import load_gpt, loss_fn
from geotrain.node.stage import StageRuntime
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler import placement
from geotrain.scheduler.service import fetch_model_state
from tests.conftest import (
    REPO, descendants, geotrain_env, local_cluster, max_diff, run_cli, running_of, train_local_state, wait_until,
)

pytestmark = pytest.mark.cluster  # every test here starts a coordinator and nodes


def _pipeline_against_local(
    tmp_path: Path, nodes: int, settings: list[str]
) -> tuple[pb.Plan, dict, float, dict[str, float]]:
    """A run of `nodes` local nodes and its plan, its final parameters, their largest difference from train-local's,
    and the round trips the nodes reported with the last step's gradient norms. Each node times each layer once: no
    plan here needs more than the layers' rough cost."""
    cfg = load_config(None, [*settings, "profile.layer_repeats=1"])
    with local_cluster(cfg, nodes, tmp_path) as cluster:
        summary = cluster.wait(90)
        plan = cluster.coordinator.plan
        state = fetch_model_state(plan, cluster.token, summary.steps, cluster.coordinator.key)
        round_trips = dict(cluster.coordinator.driver.progress.round_trip_s)
    assert summary.steps == cfg.run.steps
    return plan, state, max_diff(state, train_local_state(cfg)), round_trips


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("nodes", "settings", "ranges"),
    [
        # 3 blocks + embedding + head = 5 layers on 2 stages: a 3 / 2 split.
        (2, ["model.n_layers=3", "train.microbatches=5"], [(0, 3), (3, 5)]),
        # The boundaries carry 8 of 128 values per token; the middle and last stages rebuild the stream from them and
        # the token ids.
        (3, ["model.boundary_rank=8", "train.microbatches=6", "train.inflight=3"], [(0, 2), (2, 4), (4, 6)]),
    ],
    ids=["two_uneven_stages", "three_stages_boundary_rank"],
)
def test_stages_equal_train_local(tmp_path, nodes, settings, ranges):
    # Three dense stages equal train-local too, bit for bit over 100 steps: test_exact_long.
    settings = [*settings, "run.steps=5", "run.eval_every=0", "scheduler.placement=uniform"]
    plan, state, diff, _ = _pipeline_against_local(tmp_path, nodes, settings)
    assert [(s.layer_start, s.layer_end) for s in plan.stages] == ranges and diff <= 1e-4
    # The parameters the run changed: they differ from the initial ones.
    cfg = load_config(None, settings)
    initial = dict(StageRuntime(cfg, 0, cfg.model.total_layers).named_state())
    assert max_diff(initial, state) > 1e-3


@pytest.mark.timeout(120)
def test_demo_default_run_learns_and_reports_json(tmp_path):
    result = run_cli("demo", "--nodes", "3", "--json", "--save-final", str(tmp_path / "m.safetensors"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(summary) == {
        "steps", "loss_first", "loss_last", "val_loss", "val_bits_per_byte", "tokens_per_s", "wall_s", "nodes", "stages",
        "stage_nodes", "validation", "wire_bytes", "raw_bytes", "stream_bytes", "estimated_step_s", "relayed_bytes", "averaging_bytes",
        "peak_memory_bytes", "inflight",
    }
    assert summary["steps"] == load_config().run.steps and summary["nodes"] == 3 and summary["stages"] == 3
    assert sorted(n for stage in summary["stage_nodes"] for n in stage) == ["node-1", "node-2", "node-3"]
    assert summary["peak_memory_bytes"] > 0  # the nodes' heartbeats report it
    # A byte model starts near ln(256) = 5.5; within the default steps it must clearly learn the corpus.
    assert summary["loss_first"] > 5.0
    assert summary["loss_last"] < summary["loss_first"] - 1.5
    assert summary["val_loss"] < summary["loss_first"] - 1.5
    assert summary["val_bits_per_byte"] == pytest.approx(summary["val_loss"] / math.log(2))  # a token is a byte
    # The saved model loads back in the model zoo and scores the run's last validation pass as the run did.
    cfg = load_config()
    model = load_gpt(tmp_path / "m.safetensors", cfg.model)
    corpus = Corpus.load(cfg.data)
    losses = []
    with torch.no_grad():
        for mb in range(cfg.run.eval_microbatches):
            x, y = corpus.batch(seed=cfg.run.seed, step=cfg.run.steps - 1, microbatch=mb, size=cfg.train.microbatch_size,
                                seq_len=cfg.model.seq_len, validation=True)
            losses.append(loss_fn(model(x), y).item())
    assert sum(losses) / len(losses) == pytest.approx(summary["val_loss"], abs=1e-4)
    # Every validation pass with its step and training seconds so far; the last is the run's; bytes crossed links.
    steps_done = [step for step, _, _ in summary["validation"]]
    assert steps_done == list(range(cfg.run.eval_every, cfg.run.steps + 1, cfg.run.eval_every))
    assert summary["validation"][-1][1] == summary["val_loss"]
    seconds = [s for _, _, s in summary["validation"]]
    assert seconds == sorted(seconds) and 0 < seconds[-1] <= summary["wall_s"]
    assert summary["wire_bytes"] == summary["raw_bytes"] > 0  # codec none
    assert summary["stream_bytes"] == summary["wire_bytes"]  # every tensor over the raw streams, the default


@pytest.mark.timeout(90)
def test_sigkill_stops_demo_and_its_nodes():
    # After SIGKILL the nodes follow the demo's forkserver, which ends with the demo: nothing the demo started
    # outlives it. (test_status_page's live demo ends by SIGTERM, whose handler stops the nodes.)
    proc = subprocess.Popen(
        [sys.executable, "-m", "geotrain", "demo", "--nodes", "2", "--steps", "100000", "--set", "profile.layer_repeats=1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=geotrain_env(), cwd=REPO,
    )
    try:
        for line in proc.stdout:
            if line.startswith("step"):
                break
        started = descendants(proc.pid)
        names = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in started}
        assert sorted(n for n in names.values() if n.startswith("gt-")) == [process_name("node-1"), process_name("node-2")]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=15)
        wait_until(lambda: not running_of(started), 10, "every process the demo started to end")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(120)
def test_auto_window_from_the_plan_equals_train_local(tmp_path):
    # train.inflight = "auto" (the default): the measured plan carries its window, which the data heads keep.
    settings = ["run.steps=4", "train.microbatches=6", "run.eval_every=0", "scheduler.placement=measured"]
    assert load_config(None, settings).train.inflight == 0
    plan, _, diff, round_trips = _pipeline_against_local(tmp_path, 3, settings)
    assert 1 <= plan.inflight <= 6 and diff <= 1e-4
    # The data head measured its microbatches' round trip for the window's calibration; no other stage has one.
    heads = set(plan.stages[0].node_ids)
    assert set(round_trips) == set(placement.plan_nodes(plan))
    assert all((seconds > 0) == (node in heads) for node, seconds in round_trips.items()), round_trips
