"""Run config: TOML + overrides into validating dataclasses, and the CLI's handling of bad values."""

from __future__ import annotations

import pytest

from geotrain.cli import build_parser
from geotrain.commands.demo import per_node_flags
from geotrain.config import AUTO_INFLIGHT, ConfigError, LimitsSection, RunConfig, build_config, from_proto, load_config, to_proto
from geotrain.protocol.limits import LimitValues
from tests.conftest import run_cli


def test_defaults_are_valid_and_round_trip_the_wire():
    cfg = RunConfig()
    assert cfg.model.total_layers == cfg.model.n_layers + 2
    cfg.data.paths = ["a/*.txt"]
    cfg.train.lr = 1.234567891e-3
    back = from_proto(to_proto(cfg))
    assert back.train == cfg.train and back.model == cfg.model and back.data == cfg.data and back.run == cfg.run


def test_toml_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nn_layers = 2\nd_model = 64\n[train]\nlr = 0.01\n[data]\npaths = ["x.txt"]\n')
    cfg = load_config(path, ["model.n_heads=2", "train.lr=0.02", "data.paths=a.txt,b.txt"])
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads) == (2, 64, 2)
    assert cfg.train.lr == 0.02
    assert cfg.data.paths == ["a.txt", "b.txt"]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"train": {"lr": 5}}, "train.lr must be in"),
        ({"model": {"n_layers": 0}}, "model.n_layers must be in [1, 1024], got 0"),
        ({"model": {"d_model": 100, "n_heads": 3}}, "model.n_heads must divide"),
        ({"train": {"microbatches": "many"}}, "train.microbatches must be an integer"),
        ({"train": {"nope": 1}}, "unknown key train.nope; known: "),
        ({"model": {"n_layer": 1}}, "unknown key model.n_layer; did you mean model.n_layers?"),
        ({"bogus": {}}, "unknown section [bogus]; known: "),
        ({"schedular": {}}, "unknown section [schedular]; did you mean scheduler?"),
        ({"scheduler": {"heartbeat_interval_s": 2, "heartbeat_timeout_s": 1}}, "heartbeat_timeout_s must exceed"),
        ({"scheduler": {"allreduce": "ring"}}, "scheduler.allreduce must be auto, flat or hierarchical, got 'ring'"),
        ({"model": {"boundary_rank": -1}}, "model.boundary_rank must be in [0, 65536], got -1"),
        ({"model": {"boundary_rank": 129}}, "model.boundary_rank must be at most model.d_model (128), got 129"),
        ({"model": {"boundary_rank": "8.5"}}, "model.boundary_rank must be an integer"),
        ({"model": {"family": "llama", "boundary_rank": 8, "tie_embeddings": True}}, "model.boundary_rank cannot"),
    ],
)
def test_bad_values_name_the_key(raw, message):
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert message in str(err.value)


def test_lr_schedule_and_clip():
    t = RunConfig().train
    assert t.lr_at(0, 100) == pytest.approx(t.lr / t.warmup_steps)
    assert t.lr_at(t.warmup_steps, 100) == pytest.approx(t.lr)
    assert t.lr_at(100, 100) == pytest.approx(t.min_lr)
    assert t.clip_coefficient(0.25) == 1.0
    assert t.clip_coefficient(16.0) == pytest.approx(t.grad_clip / 4.0, rel=1e-6)


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_cli_bad_value_is_one_line_exit_2():
    result = run_cli("train-local", "--set", "train.lr=7")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.lr must be in" in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_help_has_a_sentence_and_an_example():
    result = run_cli("--help")
    assert result.returncode == 0 and "demo" in result.stdout
    for command in ("coordinator", "join", "demo", "train-local", "plan"):
        out = run_cli(command, "--help").stdout
        assert "example:" in out and f"geotrain {command}" in out, command


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_demo_refuses_more_stages_than_nodes():
    result = run_cli("demo", "--nodes", "2", "--stages", "3")
    assert result.returncode == 2
    assert "--stages 3 needs at least 3 nodes" in result.stderr


def test_demo_node_flags_from_regions_and_uplink():
    args = build_parser().parse_args(["demo", "--nodes", "3", "--regions", "eu,us", "--uplink", "20/50"])
    flags = per_node_flags(args)
    # Demo nodes compute on the CPU unless told otherwise: a GPU box's demo stays the exactness reference.
    assert flags["node-1"] == ["--region", "eu", "--bandwidth-mbps", "20", "--latency-ms", "50", "--device", "cpu"]
    assert flags["node-3"][:2] == ["--region", "eu"] and flags["node-2"][:2] == ["--region", "us"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--uplink", "fast"])


def test_replica_rank_follows_replica_grads():
    assert load_config().compression.replica_rank is None
    assert load_config(None, ["compression.replica_grads=powersgd"]).compression.replica_rank == 4
    assert load_config(None, ["compression.replica_grads=powersgd:rank=8"]).compression.replica_rank == 8


def test_a_servers_limits_before_the_run_config_arrives_are_the_configs_defaults():
    # protocol/ cannot import config, so LimitValues writes the defaults down again; they must not drift apart.
    assert LimitsSection().values() == LimitValues()
