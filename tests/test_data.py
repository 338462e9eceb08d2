"""Bring your own data: `geotrain tokenizer train` and `geotrain data prepare` (.txt, .jsonl, .parquet) write a
prepared data set once, whole or not at all; its windows are a pure function of (seed, step, microbatch id); the
coordinator serves them over gRPC to members only, for steps and microbatches the run issues; a node refuses windows
of another data set; bad input is one line and exit 2."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from geotrain import prepare as prep
from geotrain.config import load_config
from geotrain.dataset import MANIFEST, TOKENIZER, DatasetError, PreparedDataset, sha256_file
from geotrain.node.data import CoordinatorTokens, PreparedTokens, WindowsRefused, check_windows
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.auth import new_token
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.transport import make_channel
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler.coordinator import Coordinator
from geotrain.scheduler.service import make_coordinator_server
from tests.conftest import REPO, expect_status, geotrain_env, run_cli, wait_until
from tests.test_cli_errors import one_line_error

pytestmark = pytest.mark.timeout(60)

_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _documents(n: int, seed: int = 0) -> list[str]:
    """n short documents of varied words and a little non-ASCII text (bytes per token differ from characters)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, size=40 + 7 * i % 30)) + f" naïve café {i}\n" for i in range(n)]


def write_text_corpus(directory: Path, n: int = 8) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    docs = _documents(n)
    for i, doc in enumerate(docs):
        (directory / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str], Path]:
    """A corpus of eight .txt documents and a BPE tokenizer trained on it (in process, fast)."""
    base = tmp_path_factory.mktemp("corpus")
    docs = write_text_corpus(base / "text")
    tokenizer = base / "tok.json"
    prep.train_tokenizer([str(base / "text" / "*.txt")], 300, tokenizer)
    return base / "text", docs, tokenizer


def _expected_tokens(docs: list[str], tokenizer_path: Path) -> tuple[list[int], list[int]]:
    """Each document's token ids (the separator before every document but the first), and its UTF-8 bytes."""
    tok = prep.load_tokenizer(tokenizer_path)
    sep = tok.token_to_id("<|endoftext|>")
    ids, ends = [], []
    for i, doc in enumerate(docs):
        ids += ([sep] if i else []) + tok.encode(doc, add_special_tokens=False).ids
        ends.append(len(ids))
    return ids, ends


def _check_prepared(out: Path, docs: list[str], tokenizer: Path) -> PreparedDataset:
    """The data set at `out` holds exactly the documents' tokens, split between documents, with true counts and
    checksums and the tokenizer copied."""
    dataset = PreparedDataset.open(out, verify=True)
    ids, ends = _expected_tokens(docs, tokenizer)
    stored = np.concatenate([dataset.train.read(0, len(dataset.train)), dataset.val.read(0, len(dataset.val))])
    assert stored.tolist() == ids
    assert len(dataset.train) in ends[:-1]  # the split falls between documents
    split_doc = ends.index(len(dataset.train)) + 1
    m = dataset.manifest
    assert m["splits"]["train"]["bytes"] == sum(len(d.encode()) for d in docs[:split_doc])
    assert m["splits"]["val"]["bytes"] == sum(len(d.encode()) for d in docs[split_doc:])
    assert m["documents"] == len(docs) and m["dtype"] == "uint16"
    assert m["tokenizer"]["vocab_size"] == prep.load_tokenizer(tokenizer).get_vocab_size(with_added_tokens=True)
    assert sha256_file(out / TOKENIZER) == sha256_file(tokenizer) == m["tokenizer"]["sha256"]
    for split in ("train", "val"):
        for shard in m["splits"][split]["shards"]:
            assert sha256_file(out / shard["file"]) == shard["sha256"]
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")) == []  # no leftovers
    return dataset


# -- the commands, as a user runs them --------------------------------------------------------------------------


@pytest.mark.cluster
def test_tokenizer_train_then_prepare_txt(corpus, tmp_path):
    text, docs, _ = corpus
    trained = run_cli("tokenizer", "train", "--input", str(text / "*.txt"), "--vocab", "280", "--out",
                      str(tmp_path / "tok.json"))
    assert trained.returncode == 0, trained.stderr
    tok = prep.load_tokenizer(tmp_path / "tok.json")
    assert 257 <= tok.get_vocab_size(with_added_tokens=True) <= 280
    assert tok.decode(tok.encode(docs[0]).ids) == docs[0]  # byte-level: the text comes back unchanged
    result = run_cli("data", "prepare", "--input", str(text / "*.txt"), "--tokenizer", str(tmp_path / "tok.json"),
                     "--out", str(tmp_path / "data"), "--val-fraction", "0.3")
    assert result.returncode == 0, result.stderr
    dataset = _check_prepared(tmp_path / "data", docs, tmp_path / "tok.json")
    assert f"data.prepared={tmp_path / 'data'}" in result.stdout
    assert 0.2 < len(dataset.val) / (len(dataset.train) + len(dataset.val)) < 0.45


@pytest.mark.cluster
def test_prepare_jsonl_text_field(corpus, tmp_path):
    _, docs, tokenizer = corpus
    lines = [json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:5]) + "\n\n")  # a blank line is skipped
    (tmp_path / "b.jsonl").write_text("\n".join(lines[5:]) + "\n")
    result = run_cli("data", "prepare", "--input", str(tmp_path / "*.jsonl"), "--tokenizer", str(tokenizer),
                     "--out", str(tmp_path / "data"), "--text-field", "body")
    assert result.returncode == 0, result.stderr
    _check_prepared(tmp_path / "data", docs, tokenizer)


def test_prepare_parquet_text_column(corpus, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    _, docs, tokenizer = corpus
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), tmp_path / "docs.parquet", row_group_size=3)
    prep.prepare([str(tmp_path / "docs.parquet")], tokenizer, tmp_path / "data")
    _check_prepared(tmp_path / "data", docs, tokenizer)
    with pytest.raises(DatasetError, match=r"has no column 'content' \(columns: text, n"):
        prep.prepare([str(tmp_path / "docs.parquet")], tokenizer, tmp_path / "other", text_field="content")
    assert not (tmp_path / "other").exists()


@pytest.mark.cluster
def test_parquet_without_pyarrow_says_so_in_one_line(corpus, tmp_path):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("pyarrow is installed: test_prepare_parquet_text_column reads parquet")
    _, _, tokenizer = corpus
    (tmp_path / "docs.parquet").write_bytes(b"PAR1")
    result = run_cli("data", "prepare", "--input", str(tmp_path / "docs.parquet"), "--tokenizer", str(tokenizer),
                     "--out", str(tmp_path / "data"))
    one_line_error(result, 2, "needs pyarrow, which is not installed (pip install pyarrow)")
    assert not (tmp_path / "data").exists()


def _bad_inputs(base: Path, tokenizer: Path) -> dict[str, tuple[list[str], str]]:
    """Each bad input: the command's arguments and what its one line says."""
    write_text_corpus(base / "good", 3)
    (base / "empty").mkdir()
    for name in ("a.txt", "b.txt"):
        (base / "empty" / name).write_text("")
    (base / "nofield.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    (base / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (base / "gone.txt").symlink_to(base / "nowhere.txt")
    (base / "not-a-tokenizer.json").write_text("{}")
    (base / "taken").mkdir()
    (base / "taken" / "keep.txt").write_text("someone's file")
    good = ["--input", str(base / "good" / "*.txt")]
    out = ["--out", str(base / "out")]
    tok = ["--tokenizer", str(tokenizer)]
    return {
        "empty dataset": (["--input", str(base / "empty" / "*.txt"), *tok, *out], "the input holds no text"),
        "no matching files": (["--input", str(base / "none" / "*.txt"), *tok, *out], "matches no files"),
        "missing text field": (
            [*good, "--input", str(base / "nofield.jsonl"), *tok, *out], "nofield.jsonl line 2 has no string field 'text'"
        ),
        "not UTF-8": ([*good, "--input", str(base / "latin1.txt"), *tok, *out], "latin1.txt is not UTF-8 text"),
        "unreadable file": (
            [*good, "--input", str(base / "gone.txt"), *tok, *out], "cannot read " + str(base / "gone.txt")
        ),
        "no tokenizer": ([*good, "--tokenizer", str(base / "missing.json"), *out], "missing.json: no such file"),
        "not a tokenizer": ([*good, "--tokenizer", str(base / "not-a-tokenizer.json"), *out], "is not a tokenizer.json"),
        "one document": (["--input", str(base / "good" / "doc00.txt"), *tok, *out], "the input is one document"),
        "output taken": ([*good, *tok, "--out", str(base / "taken")], "taken exists and is not an empty directory"),
    }


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_bad_inputs_get_one_line_exit_2_and_write_nothing(corpus, tmp_path):
    """Each bad input fails in one line with exit 2; none leaves the output or a temporary directory behind (the
    bad file comes after a good one, so the failure is mid-way)."""
    cases = _bad_inputs(tmp_path, corpus[2])
    script = (
        "import contextlib, io, json, sys\nfrom geotrain.cli import main\nresults = {}\n"
        f"for name, (args, _) in {cases!r}.items():\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
        "        code = main(['data', 'prepare', *args])\n"
        "    results[name] = [code, err.getvalue()]\n"
        "print(json.dumps(results))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100,
                          env=geotrain_env(), cwd=REPO)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    for name, (_, text) in cases.items():
        code, stderr = results[name]
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, (name, stderr)
        assert text in lines[0], (name, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir() if "out" in p.name or "taken." in p.name) == []
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]


@pytest.mark.cluster
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_interrupted_prepare_leaves_no_data_set(corpus, tmp_path, sig):
    """A prepare stopped mid-way (it blocks reading a FIFO, after the first file) never leaves the output directory;
    SIGTERM also removes its temporary one."""
    text, _, tokenizer = corpus
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.txt").write_text((text / "doc00.txt").read_text())
    os.mkfifo(inputs / "z.txt")
    proc = subprocess.Popen(
        [sys.executable, "-m", "geotrain", "data", "prepare", "--input", str(inputs / "*.txt"), "--tokenizer",
         str(tokenizer), "--out", str(tmp_path / "data")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=geotrain_env(), cwd=REPO,
    )
    try:
        temporary = tmp_path / f".data.tmp-{proc.pid}"
        wait_until(temporary.exists, 30, "prepare to start writing")
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (tmp_path / "data").exists()
    if sig == signal.SIGTERM:
        assert proc.returncode == 130 and stderr.strip() == "geotrain: interrupted"
        assert not temporary.exists()
    else:
        assert proc.returncode == -signal.SIGKILL


@pytest.mark.cluster
def test_run_refuses_a_tokenizer_larger_than_the_model_and_a_changed_data_set(corpus, tmp_path):
    text, _, tokenizer = corpus
    prep.prepare([str(text / "*.txt")], tokenizer, tmp_path / "data")
    vocab = PreparedDataset.open(tmp_path / "data").vocab_size
    llama = ["--set", "model.family=llama", "--set", f"model.vocab_size={vocab - 1}", "--set", "model.seq_len=16",
             "--set", f"data.prepared={tmp_path / 'data'}", "--steps", "1"]
    one_line_error(run_cli("train-local", *llama), 2,
                   f"has {vocab} tokens, more than model.vocab_size ({vocab - 1}): set model.vocab_size to at least")
    byte_gpt = run_cli("train-local", "--set", f"data.prepared={tmp_path / 'data'}", "--steps", "1")
    one_line_error(byte_gpt, 2, f'reads bytes: set model.family = "llama" and model.vocab_size = {vocab}')
    shard = tmp_path / "data" / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    llama[3] = f"model.vocab_size={vocab}"
    one_line_error(run_cli("train-local", *llama), 2, "fails its sha256: the data set changed after it was prepared")
    one_line_error(run_cli("train-local", "--set", f"data.prepared={tmp_path}", "--steps", "1"), 2,
                   f"data.prepared: {tmp_path} is no prepared data set: cannot read {MANIFEST}")


# -- sampling -----------------------------------------------------------------------------------------------------


def test_windows_are_a_pure_function_of_seed_step_and_microbatch(corpus, tmp_path, monkeypatch):
    text, _, tokenizer = corpus
    monkeypatch.setattr(prep, "SHARD_TOKENS", 97)  # many shards: windows cross their boundaries
    prep.prepare([str(text / "*.txt")], tokenizer, tmp_path / "data", val_fraction=0.3)
    dataset = PreparedDataset.open(tmp_path / "data", verify=True)
    assert len(dataset.manifest["splits"]["train"]["shards"]) > 3
    train = dataset.train.read(0, len(dataset.train))
    val = dataset.val.read(0, len(dataset.val))
    args = dict(seed=7, step=3, microbatch=2, size=16, seq_len=12)
    first = dataset.windows(**args)
    again = PreparedDataset.open(tmp_path / "data").windows(**args)  # another process's view: the same tokens
    assert first.shape == (16, 13) and first.dtype == np.int64 and np.array_equal(first, again)
    # Each window is a run of consecutive tokens of its split.
    joined = train.tolist()
    assert all(any(joined[s : s + 13] == w.tolist() for s in range(len(joined) - 12)) for w in first)
    others = [dict(args, seed=8), dict(args, step=4), dict(args, microbatch=3)]
    assert all(not np.array_equal(first, dataset.windows(**o)) for o in others)
    held_out = dataset.windows(**args, validation=True)
    joined_val = val.tolist()
    assert all(any(joined_val[s : s + 13] == w.tolist() for s in range(len(joined_val) - 12)) for w in held_out)
    x, y = PreparedTokens(dataset).batch(**args)
    assert np.array_equal(x.numpy(), first[:, :-1]) and np.array_equal(y.numpy(), first[:, 1:])
    # Bits per byte: nats per token times tokens per byte of the held-out text, over ln 2.
    m = dataset.manifest["splits"]["val"]
    assert dataset.bits_per_byte(2.0) == pytest.approx(2.0 * m["tokens"] / m["bytes"] / math.log(2))


# -- windows over the wire ----------------------------------------------------------------------------------------


@pytest.fixture
def served(corpus, tmp_path):
    """A coordinator serving a prepared data set over gRPC (port 0), with one registered member; yields the
    coordinator, a channel as that member, and the data set."""
    text, _, tokenizer = corpus
    prep.prepare([str(text / "*.txt")], tokenizer, tmp_path / "data")
    dataset = PreparedDataset.open(tmp_path / "data")
    cfg = load_config(None, [
        "model.family=llama", f"model.vocab_size={dataset.vocab_size}", "model.seq_len=16", "run.steps=5",
        "train.microbatches=3", "run.eval_microbatches=2", f"data.prepared={tmp_path / 'data'}",
    ])
    cfg.data.fingerprint = dataset.fingerprint
    coordinator = Coordinator(cfg)
    key = NodeKey.generate()  # a member's windows are served only to calls that member signed
    reply = coordinator.register(pb.RegisterRequest(
        protocol_version=PROTOCOL_VERSION, node_id="node-1", address="127.0.0.1:1", region="eu", public_key=key.public,
    ), key.public)
    assert reply.accepted, reply.message
    token = new_token()
    server, port = make_coordinator_server(coordinator, token, "127.0.0.1:0")
    server.start()
    channel = make_channel(f"127.0.0.1:{port}", token, lambda: "node-1", key=key)
    try:
        yield coordinator, channel, dataset
    finally:
        channel.close()
        server.stop(grace=0).wait(5)


def test_nodes_fetch_the_windows_train_local_reads(served):
    coordinator, channel, dataset = served
    cfg = coordinator.cfg
    tokens = CoordinatorTokens(rpc.CoordinatorStub(channel), lambda: "node-1", cfg)
    for step, microbatch, validation in [(0, 0, False), (4, 2, False), (2, 1, True)]:
        args = dict(seed=cfg.run.seed, step=step, microbatch=microbatch, size=cfg.train.microbatch_size,
                    seq_len=cfg.model.seq_len, validation=validation)
        x, y = tokens.batch(**args)
        local_x, local_y = PreparedTokens(dataset).batch(**args)
        assert x.equal(local_x) and y.equal(local_y)


def test_windows_requests_are_bounded_and_for_members_only(served):
    coordinator, channel, _ = served
    stub = rpc.CoordinatorStub(channel)
    bad = {
        "step 5 microbatch 0 is not one of the run's 5 steps": pb.WindowsRequest(node_id="node-1", step=5),
        "microbatch 3 is not one of the run's 5 steps of 3 microbatches": pb.WindowsRequest(
            node_id="node-1", microbatch=3
        ),
        "of 2 validation microbatches": pb.WindowsRequest(node_id="node-1", microbatch=2, validation=True),
        "not a live member of the run": pb.WindowsRequest(node_id="stranger"),
    }
    for text, request in bad.items():
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, text, lambda: stub.Windows(request, timeout=10))
    # The same member still gets its windows: nothing changed.
    assert stub.Windows(pb.WindowsRequest(node_id="node-1", step=4, microbatch=2), timeout=10).rows == 8


def test_a_node_refuses_windows_of_another_data_set(served):
    coordinator, channel, _ = served
    cfg = coordinator.cfg
    reply = rpc.CoordinatorStub(channel).Windows(pb.WindowsRequest(node_id="node-1"), timeout=10)
    size, seq_len = cfg.train.microbatch_size, cfg.model.seq_len
    assert check_windows(reply, cfg, size, seq_len).shape == (size, seq_len + 1)
    joined_elsewhere = load_config(None, ["model.family=llama", "model.vocab_size=300"])
    joined_elsewhere.data.fingerprint = "0" * 64
    with pytest.raises(WindowsRefused, match="the coordinator serves data set .*, this node joined a run on 000000"):
        check_windows(reply, joined_elsewhere, size, seq_len)
    with pytest.raises(WindowsRefused, match=r"windows of 8 x 17 .* expected 4 x 17"):
        check_windows(reply, cfg, 4, seq_len)
    small_vocab = load_config(None, ["model.family=llama", "model.vocab_size=2"])
    small_vocab.data.fingerprint = cfg.data.fingerprint
    with pytest.raises(WindowsRefused, match="outside the model's 2"):
        check_windows(reply, small_vocab, size, seq_len)


def test_a_byte_corpus_run_serves_no_windows():
    coordinator = Coordinator(load_config())
    coordinator.register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id="n", address="127.0.0.1:1"))
    from geotrain.scheduler.errors import ReportRefused

    with pytest.raises(ReportRefused, match="trains on the byte corpus"):
        coordinator.windows(pb.WindowsRequest(node_id="n"))
