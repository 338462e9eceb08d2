"""bench/time_to_target.py, bench/versus.py and bench/window.py: their command lines and tables, the figures of a
run's summary, and one tiny run of each kind end to end (geotrain through the link emulator, torch pipelining and
hivemind on loopback)."""

from __future__ import annotations

import importlib.util
import sys
import time

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ttt = _load("time_to_target")
versus = _load("versus")

TINY_MODEL = ["model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.seq_len=8"]
TINY_TRAIN = ["train.microbatches=6", "train.microbatch_size=2", "train.inflight=6"]


def test_configs_cover_the_issue_and_parse(capsys):
    assert {"none", "int8", "auto"} <= set(ttt.CONFIGS)
    ranks = [c for c in ttt.CONFIGS.values() if any(s.startswith("model.boundary_rank=") for s in c.settings)]
    syncs = {s for c in ttt.CONFIGS.values() for s in c.settings if s.startswith("compression.replica_sync=")}
    assert len(ranks) >= 2 and syncs == {"compression.replica_sync=every_step", "compression.replica_sync=diloco"}
    assert all(c.replicas == 2 for c in ttt.CONFIGS.values() if any("replica_sync" in s for s in c.settings))
    args = ttt.parser().parse_args(["--configs", "int8,rank8", "--steps", "7", "--links", "emulator"])
    assert (args.configs, args.steps, args.links) == (["int8", "rank8"], 7, "emulator")
    assert ttt.parser().parse_args([]).configs == ["none", "int8", "auto"]
    with pytest.raises(SystemExit):
        ttt.parser().parse_args(["--configs", "none,zip"])
    assert "unknown configuration(s) zip; choose from none, int8" in capsys.readouterr().err
    settings = ttt.run_settings(ttt.CONFIGS["int8"], 12)
    assert "run.steps=12" in settings and "compression.activations=int8" in settings
    assert settings[: len(ttt.MODEL)] == ttt.MODEL


def test_window_bench_sets_each_window_and_reports_the_nodes_peak_memory(capsys):
    window = _load("window")  # its helpers are time_to_target's (loaded above)
    assert window.parser().parse_args([]).windows == ["1", "4", "16", "auto"]
    with pytest.raises(SystemExit):
        window.parser().parse_args(["--windows", "4,8"])
    assert "unknown window(s) 8" in capsys.readouterr().err
    settings = window.settings("auto", 5)
    assert "train.inflight=auto" in settings and "run.steps=5" in settings and settings[: len(ttt.MODEL)] == ttt.MODEL
    summary = {"tokens_per_s": 1234.56, "peak_memory_bytes": 5_000_000, "inflight": 9, "estimated_step_s": 1.23456}
    assert window.figures("auto", summary, "emulator") == {
        "window": "auto", "links": ttt.links_label("emulator"), "tokens_per_s": 1234.6,
        "peak_memory_bytes": 5_000_000, "inflight": 9, "estimated_step_s": 1.235}


def test_versus_systems_parse(capsys):
    assert versus.parser().parse_args(["--systems", "torch_1f1b,hivemind"]).systems == ["torch_1f1b", "hivemind"]
    with pytest.raises(SystemExit):
        versus.parser().parse_args(["--systems", "deepspeed"])
    assert "unknown system(s) deepspeed" in capsys.readouterr().err
    args = versus.parser().parse_args(["--best", "auto,rank8", "--pace-steps", "3", "--size", "large",
                                       "--links", "loopback", "--steps-to-target", "none=90,rank8=30"])
    assert (args.best, args.pace_steps, args.systems) == (["auto", "rank8"], 3, list(versus.SYSTEMS))
    assert (args.size, args.links, args.steps_to_target) == ("large", "loopback", {"none": 90, "rank8": 30})
    with pytest.raises(SystemExit):
        versus.parser().parse_args(["--steps-to-target", "zip=3"])


def test_sizes_and_links_name_themselves():
    from geotrain.config import load_config

    assert ttt.tokens_per_step("small") == 3072 and ttt.tokens_per_step("large") == 768
    assert load_config(None, ttt.size_settings("large")).model.d_model == 512
    assert ttt.run_settings(ttt.CONFIGS["none"], 5, "large", eval_every=0)[: len(ttt.LARGE_MODEL)] == ttt.LARGE_MODEL
    assert "run.eval_every=0" in ttt.run_settings(ttt.CONFIGS["none"], 5, "large", eval_every=0)
    assert ttt.links_label("loopback").startswith("loopback") and "50 Mbit/s" in ttt.links_label("namespaces")


def test_step_seconds_run_from_commit_to_commit():
    import json

    lines = [json.dumps(x) for x in [
        {"kind": "step", "step": 1, "time": 10.0, "val_loss": None},
        {"kind": "step", "step": 2, "time": 11.0, "val_loss": None},
        {"kind": "step", "step": 3, "time": 13.5, "val_loss": 2.0},  # its validation pass counts in its time
        {"kind": "step", "step": 4, "time": 14.0, "val_loss": None},
        {"kind": "failure", "step": 4, "time": 20.0},
        {"kind": "step", "step": 5, "time": 22.0, "val_loss": None},  # after a failure
        {"kind": "step", "step": 6, "time": 22.5, "val_loss": None},
    ]]
    assert ttt.commit_spans(lines) == [(10.0, 11.0), (13.5, 14.0), (22.0, 22.5)]


def test_the_late_target_is_nones_pass_at_ninety_percent():
    summary = {"validation": [(300, 2.5, 1.0), (850, 2.0, 2.0), (900, 1.9, 3.0), (950, 1.95, 4.0), (1000, 1.8, 5.0)]}
    assert ttt.late_target(summary, 1000) == 1.9


def test_figures_come_from_the_summary():
    summary = {"steps": 30, "validation": [(10, 3.0, 5.0), (20, 2.4, 11.0), (30, 2.1, 16.5)], "val_loss": 2.1,
               "wire_bytes": 6_000_000, "stream_bytes": 6_000_000, "averaging_bytes": 0, "tokens_per_s": 500.0}
    assert ttt.to_target(summary, 2.5) == (20, 11.0)
    assert ttt.to_target(summary, 1.0) == (None, None)
    fig = ttt.figures("none", ttt.CONFIGS["none"], summary, "namespaces", 2.5)
    assert (fig["steps_to_target"], fig["seconds_to_target"], fig["val_loss_at_equal_tokens"]) == (20, 11.0, 2.1)
    tokens = 30 * ttt.tokens_per_step()
    assert fig["tokens"] == tokens and fig["boundary_bytes_per_token"] == round(6_000_000 / tokens, 1)
    assert fig["averaging_bytes_per_step"] == 0 and "namespaces" in fig["links"]
    # The transport is the nodes' count, not the run's setting: a stream port no relay forwarded shows as calls.
    assert fig["tensor_transport"] == "raw tensor stream"
    assert ttt.tensor_transport({**summary, "stream_bytes": 0}) == "gRPC calls"
    assert ttt.tensor_transport({**summary, "stream_bytes": 1_500_000}) == (
        "raw tensor stream 25.0% of bytes, gRPC calls the rest")
    # Two replicas per stage: the averaging bytes the run reports, per step.
    replicas = ttt.CONFIGS["replicas_diloco"]
    assert ttt.figures("d", replicas, {**summary, "averaging_bytes": 900}, "emulator", 2.5)[
        "averaging_bytes_per_step"] == 30


def test_geotrain_line_is_its_paced_run_under_the_default_plan(monkeypatch):
    summary = {"steps": 20, "stages": 3, "nodes": 3, "stage_nodes": [["r0n0"], ["r1n0"], ["r2n0"]], "wire_bytes": 10,
               "stream_bytes": 0, "averaging_bytes": 40, "step_s": [0.5, 1.5], "step_window": [100.0, 102.0]}
    runs = []
    monkeypatch.setattr(ttt, "train", lambda config, steps, links, size, eval_every: runs.append(
        (config, steps, links, size, eval_every)) or summary)
    meter = versus.CpuMeter()
    meter.cores, meter._samples = 2, [(99.0, 0, 0), (100.0, 10, 100), (101.0, 100, 200), (102.0, 160, 300)]
    line = versus.with_target(versus.geotrain_line("geotrain_best", "int8", 20, "loopback", "small", meter),
                              {"int8": 30})
    assert runs == [(ttt.CONFIGS["int8"], 20, "loopback", "small", 0)]
    assert line == {"system": "geotrain_best", "config": "int8", "model": ttt.SIZES["small"],
                    "links": ttt.links_label("loopback"), "step_s": 1.0, "steps_measured": 2,
                    "tokens_per_s": 3072.0, "tensor_transport": "gRPC calls", "stages": 3, "nodes": 3,
                    "stage_nodes": [["r0n0"], ["r1n0"], ["r2n0"]], "averaging_bytes_per_step": 2,
                    "cpu_busy": 0.75, "cpu_s_per_step": 1.5, "steps_to_target": 30, "seconds_to_target": 30.0,
                    "seconds_to_target_from": "int8's steps_to_target x this run's mean step seconds"}


def test_cpu_meter_reads_the_machines_busy_share(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\ncpu1 50 0 25 400 25 0 0 0 0 0\n")
    meter = versus.CpuMeter(stat)
    meter.sample()
    stat.write_text(
        "cpu  400 0 150 1000 50 0 0 0 0 0\ncpu0 200 0 75 500 25 0 0 0 0 0\ncpu1 200 0 75 500 25 0 0 0 0 0\n"
    )
    meter.sample()
    assert meter.cores == 2
    first, last = meter._samples[0][0], meter._samples[1][0]
    assert meter.busy(first, last) == 400 / 600  # idle and iowait are not busy
    assert meter.busy(last, last + 1) is None  # one sample: no span
    with versus.CpuMeter(tmp_path / "absent") as absent:  # no /proc/stat: nothing measured, nothing fails
        assert absent.busy(0, time.time()) is None
    live = versus.CpuMeter()
    live.sample()
    assert live.cores >= 1


def test_the_others_take_nones_steps_and_the_cell_compares_medians():
    torch = versus.other_line("torch_1f1b", [0.5, 1.5], [5.0, 4.0], "large", "loopback")
    assert (torch["loss_first"], torch["loss_last"], torch["tokens_per_s"]) == (5.0, 4.0, 768.0)
    assert "gloo" in torch["tensor_transport"] and versus.math_of(torch) == "none"
    assert versus.with_target(torch, {"none": 40})["seconds_to_target"] == 40.0
    assert versus.with_target(torch, {})["seconds_to_target"] is None
    cell = dict(model="m", links="l", tensor_transport="t")
    records = [
        *({**cell, "system": "geotrain", "config": "none", "step_s": s} for s in (1.0, 1.2, 0.9)),
        *({**cell, "system": "geotrain_best", "config": "rank8", "step_s": s} for s in (1.0, 1.1, 1.0)),
        *({**cell, "system": "hivemind", "step_s": s} for s in (2.0, 1.0, 1.5)),
        *({**cell, "system": "torch_gpipe", "step_s": s} for s in (3.0, 3.0, 3.0)),
    ]
    *lines, verdict = versus.cell_lines(records, {"none": 10, "rank8": 4})
    assert [(x["system"], x["runs"], x["seconds_to_target_median"], x["seconds_to_target_spread"]) for x in lines] == [
        ("geotrain", 3, 10.0, [9.0, 12.0]), ("geotrain_best", 3, 4.0, [4.0, 4.4]), ("hivemind", 3, 15.0, [10.0, 20.0]),
        ("torch_gpipe", 3, 30.0, [30.0, 30.0])]
    assert lines[0]["cpu_busy_median"] is None  # runs recorded before the bench measured the CPU
    measured = [{**r, "cpu_busy": 0.9, "cpu_s_per_step": 1.8 * r["step_s"]} for r in records]
    assert versus.cell_lines(measured, {})[0]["cpu_s_per_step_median"] == 1.8
    assert verdict == {"verdict": {"model": "m", "links": "l"}, "compared_by": "seconds_to_target_median",
                       "best_other": "hivemind", "geotrain_default_vs_best_other": 1.5, "geotrain_best": "rank8",
                       "geotrain_best_vs_best_other": 3.75}
    # No steps to target for rank8: the lines of none's math, by step seconds.
    *_, verdict = versus.cell_lines(records, {})
    assert (verdict["compared_by"], verdict["best_other"], verdict["geotrain_default_vs_best_other"]) == (
        "step_s_median", "hivemind", 1.5)
    assert verdict["geotrain_best"] == "none"


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_tiny_geotrain_run_through_the_emulator(monkeypatch):
    monkeypatch.setattr(ttt, "MODEL", TINY_MODEL)
    monkeypatch.setattr(ttt, "TRAIN", TINY_TRAIN)
    monkeypatch.setattr(ttt, "EVAL_EVERY", 1)
    monkeypatch.setattr(ttt, "EVAL_MICROBATCHES", 1)
    # Three stages, whose boundaries the line counts (by default the planner gives so small a model data parallelism).
    summary = ttt.train(ttt.Config(("scheduler.stages=3",)), 3, "emulator", timeout_s=100)
    assert [steps for steps, _, _ in summary["validation"]] == [1, 2, 3]
    assert summary["step_s"] == []  # each step after the first ran a validation pass
    paced = ttt.train(ttt.Config(("scheduler.stages=3",)), 3, "loopback", timeout_s=100, eval_every=0)
    assert len(paced["step_s"]) == 1 and paced["step_s"][0] > 0  # step 2; step 3 ran the validation pass
    fig = ttt.figures("none", ttt.CONFIGS["none"], summary, "emulator", target=summary["validation"][1][1])
    assert fig["steps_to_target"] in (1, 2) and fig["seconds_to_target"] > 0
    # Two boundaries each way, 6 microbatches of 2 x 8 x 16 float32 a step, over 2 x 6 x 2 x 8 tokens a step.
    assert fig["boundary_bytes_per_token"] > 0 and "emulator" in fig["links"]
    assert fig["tensor_transport"] == "raw tensor stream"  # the default on direct links, counted by the nodes


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", sorted(set(versus.TORCH_SCHEDULES.values())))
def test_tiny_torch_pipeline_trains_what_train_local_trains(schedule):
    from geotrain.config import load_config
    from geotrain.node.local import train_local

    settings = [*TINY_MODEL, *TINY_TRAIN, "run.steps=2", "run.eval_every=0"]
    result = versus.run_torch("loopback", settings, timeout_s=100, schedule=schedule)
    assert len(result["seconds"]) == 2 and result["links"].startswith("loopback")
    start, end = result["window"]  # the second step's span, wall clock: what the CPU meter reads over
    assert time.time() - 100 < start <= end <= time.time()
    _, summary = train_local(load_config(None, settings))
    # Either schedule over the same layers, data and optimizer: geotrain's exact training (float summation order aside).
    assert result["losses"] == pytest.approx([summary["loss_first"], summary["loss_last"]], abs=1e-4)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_tiny_hivemind_run_takes_global_steps():
    settings = [*TINY_MODEL, *TINY_TRAIN, "run.steps=3"]
    result = versus.run_hivemind("loopback", settings, timeout_s=100)
    assert result["epochs"] >= 1 and result["seconds"] > 0 and result["links"].startswith("loopback")
    start, end = result["window"]
    assert time.time() - 100 < start <= end <= time.time()
