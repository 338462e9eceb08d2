"""cluster.yaml loading and validation, and `geotrain plan`'s output."""

import io
import json
from pathlib import Path

import pytest
import yaml

from geotrain.scheduler.cluster import load_cluster, parse_cluster
from geotrain.scheduler.costmodel import CostModel, ModelProfile, StepShape
from geotrain.scheduler.plan_cli import run_plan

CLUSTERS = Path(__file__).resolve().parents[1] / "deploy" / "clusters"
SMALL = dict(n_layers=4, d_model=256, n_heads=4, seq_len=128, vocab=4000)
MODEL = ModelProfile.gpt(**SMALL, microbatch_size=2)
BASE = {
    "intra_region": {"bandwidth_gbps": 10, "latency_ms": 1},
    "inter_region": [{"regions": ["a", "b"], "bandwidth_mbps": 500, "latency_ms": 40}],
    "nodes": [
        {"name": "g", "region": "a", "device": "T4", "count": 2},
        {"name": "l", "region": "b", "tflops": 1.0, "memory_gb": 8, "uplink_mbps": 50},
    ],
}


@pytest.mark.parametrize("path", sorted(CLUSTERS.glob("*.yaml")), ids=lambda p: p.stem)
def test_example_clusters_load(path):
    cluster = load_cluster(path, MODEL)
    assert len(cluster.nodes) >= 4


def test_parse_expands_counts_and_units():
    cluster = parse_cluster(BASE, MODEL)
    assert [n.node_id for n in cluster.nodes] == ["g-0", "g-1", "l"]
    g, lap = cluster.nodes[0], cluster.nodes[2]
    assert g.memory_bytes == 16 * 10**9
    # The plan is priced with the laptop's 50 Mbit/s uplink under the 500 Mbit/s, 40 ms link between the regions.
    cm = CostModel(nodes=cluster.nodes, model=MODEL, network=cluster.network, shape=StepShape(microbatches=4, microbatch_size=2))
    g_class, lap_class = cm.links.link_class[0], cm.links.link_class[2]
    assert cm.links.class_bw[g_class, lap_class] == 50e6
    assert cm.links.class_lat[g_class, lap_class] == pytest.approx(0.04)
    assert cm.links.class_bw[g_class, g_class] == 10e9 and cm.links.class_lat[g_class, g_class] == pytest.approx(0.001)


def test_coordinator_region_gives_each_node_its_round_trip():
    cluster = parse_cluster({**BASE, "coordinator_region": "b"}, MODEL)
    assert [n.coordinator_rtt_s for n in cluster.nodes] == pytest.approx([0.08, 0.08, 0.002])
    assert all(n.coordinator_rtt_s == 0 for n in parse_cluster(BASE, MODEL).nodes)  # not given: not priced
    # A coordinator in a region of no node, reached over the default link between regions.
    elsewhere = {**BASE, "coordinator_region": "c", "inter_region_default": {"bandwidth_mbps": 100, "latency_ms": 70}}
    assert [n.coordinator_rtt_s for n in parse_cluster(elsewhere, MODEL).nodes] == pytest.approx([0.14] * 3)
    with pytest.raises(ValueError, match=r"coordinator_region: no link between regions 'a' and 'c'"):
        parse_cluster({**BASE, "coordinator_region": "c"}, MODEL)
    with pytest.raises(ValueError, match=r"coordinator_region must be a region name"):
        parse_cluster({**BASE, "coordinator_region": 3}, MODEL)


def test_run_plan_prices_the_round_trip_to_the_coordinator(tmp_path):
    cluster = {
        "intra_region": {"bandwidth_gbps": 100, "latency_ms": 0.1},
        "inter_region": [{"regions": ["a", "b"], "bandwidth_gbps": 1, "latency_ms": 40}],
        "nodes": [{"name": r, "region": r, "device": "T4", "count": 2} for r in "ab"],
    }

    def planned(**extra):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({**cluster, **extra}))
        out = io.StringIO()
        assert run_plan(str(path), SMALL, microbatches=8, microbatch_size=1, as_json=True, out=out, stages=1) == 0
        plan = json.loads(out.getvalue())
        return plan["step_seconds"], plan["stages"][0]["node_ids"]

    unpriced, _ = planned()
    # Far from every node (100 ms one way): one stage's data heads each wait a round trip a step, 0.2 s.
    far = {"bandwidth_mbps": 100, "latency_ms": 100}
    assert planned(coordinator_region="c", inter_region_default=far)[0] - unpriced == pytest.approx(0.2, rel=1e-6)
    # In a region of the cluster: the lone stage is served from that region, 0.2 ms from it.
    for region in "ab":
        seconds, nodes = planned(coordinator_region=region)
        assert seconds - unpriced == pytest.approx(0.0002, rel=1e-6)
        assert nodes and all(n.startswith(f"{region}-") for n in nodes)


def with_change(path, value):
    data = yaml.safe_load(yaml.safe_dump(BASE))
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("colour",), "blue", "unknown key 'colour'"),
        (("intra_region", "bandwidth_gbps"), None, "bandwidth_mbps' or 'bandwidth_gbps"),
        (("intra_region", "bandwidth_mbps"), 100, "not both"),
        (("intra_region", "latency_ms"), -1, "intra_region.latency_ms must be >= 0"),
        (("nodes", 0, "device"), "Voodoo2", "unknown device 'Voodoo2'"),
        (("nodes", 1, "memory_gb"), None, "missing key 'memory_gb'"),
        (("nodes", 1, "layer_seconds"), [0.1], "'device', 'tflops', 'layer_seconds'"),
        (("nodes", 0, "count"), 0, "count must be an integer >= 1"),
        (("nodes", 1, "name"), "g-0", "duplicate node name 'g-0'"),
        (("inter_region",), [], "no link between regions 'a' and 'b'"),
        (("nodes",), [], "missing key 'nodes'"),
    ],
)
def test_validation_errors_name_the_key(path, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_cluster(with_change(path, value), MODEL)


def test_layer_seconds_length_checked():
    data = with_change(("nodes", 1, "tflops"), None)
    data["nodes"][1]["layer_seconds"] = [0.1, 0.2]
    with pytest.raises(ValueError, match=r"layer_seconds must list 6 numbers"):
        parse_cluster(data, MODEL)


def test_run_plan_table_and_json():
    path = str(CLUSTERS / "one-region-mixed.yaml")
    table = io.StringIO()
    assert run_plan(path, SMALL, microbatches=32, microbatch_size=2, as_json=False, out=table) == 0
    text = table.getvalue()
    assert text.startswith("stage  layers  replicas")
    for needle in ("throughput:", "compute bound:", "bottleneck:"):
        assert needle in text
    as_json = io.StringIO()
    assert run_plan(path, SMALL, microbatches=32, microbatch_size=2, as_json=True, out=as_json) == 0
    obj = json.loads(as_json.getvalue())
    assert obj["stages"][0]["start"] == 0 and obj["stages"][-1]["end"] == SMALL["n_layers"] + 2
    assert obj["samples_per_s"] <= obj["compute_bound_samples_per_s"]
    assert {"bottleneck", "excluded", "step_seconds"} <= set(obj)


def test_run_plan_reports_bad_cluster(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: []\nintra_region: {bandwidth_gbps: 1, latency_ms: 1}\n")
    err = io.StringIO()
    assert run_plan(str(bad), SMALL, microbatches=4, microbatch_size=1, as_json=False, out=io.StringIO(), err=err) == 2
    assert "missing key 'nodes'" in err.getvalue()


def test_run_plan_prices_how_replicas_average(tmp_path):
    path = tmp_path / "two.yaml"
    cluster = {
        "intra_region": {"bandwidth_gbps": 100, "latency_ms": 0.1},
        "inter_region": [{"regions": ["a", "b"], "bandwidth_gbps": 1, "latency_ms": 40}],
        "nodes": [{"name": r, "region": r, "device": "T4", "count": 2} for r in "ab"],
    }
    path.write_text(yaml.safe_dump(cluster))

    def planned(**kwargs):
        out = io.StringIO()
        assert run_plan(str(path), SMALL, microbatches=65536, microbatch_size=1, as_json=True, out=out, stages=1,
                        **kwargs) == 0
        (stage,) = json.loads(out.getvalue())["stages"]
        assert len(stage["node_ids"]) == 4
        return stage

    flat = planned(allreduce="flat")
    auto = planned()
    assert not flat["hierarchical_allreduce"] and auto["hierarchical_allreduce"]
    assert auto["allreduce_s"] < flat["allreduce_s"]
    low_rank = planned(allreduce="flat", replica_rank=2)
    assert 0 < low_rank["allreduce_s"] < flat["allreduce_s"]
    table = io.StringIO()
    assert run_plan(str(path), SMALL, microbatches=65536, microbatch_size=1, as_json=False, out=table, stages=1,
                    allreduce="hierarchical") == 0
    assert "(by region)" in table.getvalue()
