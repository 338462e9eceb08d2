"""Run state in SQLite: members, plan epoch, committed steps with their metrics, and the event log.

Every write is its own transaction, so a coordinator killed at any moment leaves a database that says exactly
which steps were committed.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STORE_FILE = "run.sqlite"
"""The run store's file name in a coordinator's --state-dir."""
_MODEL_KEY = "model_config"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY,
    loss REAL NOT NULL,
    val_loss REAL,
    tokens_per_s REAL NOT NULL,
    seconds REAL NOT NULL,
    plan_epoch INTEGER NOT NULL,
    checksums TEXT NOT NULL,
    committed_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS members (
    node_id TEXT PRIMARY KEY,
    address TEXT NOT NULL,
    region TEXT NOT NULL,
    joined_at REAL NOT NULL,
    state TEXT NOT NULL,
    public_key TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    node_id TEXT NOT NULL DEFAULT '',
    detail TEXT NOT NULL DEFAULT ''
);
"""


def recorded_model(path: str | Path) -> dict[str, Any] | None:
    """The [model] section a run's store recorded, read without writing (its coordinator may still be running)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT value FROM meta WHERE key = ?", (_MODEL_KEY,)).fetchone()
    finally:
        db.close()
    return json.loads(row[0]) if row else None


@dataclass(frozen=True)
class StepRecord:
    """One committed step."""

    step: int
    loss: float
    val_loss: float | None
    tokens_per_s: float
    seconds: float
    plan_epoch: int
    committed_at: float = 0.0


class RunStore:
    """The coordinator's durable state; `:memory:` when no state directory is given."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(members)")}
        if "public_key" not in columns:  # a run store written before node keys: its members are bound on return
            self._db.execute("ALTER TABLE members ADD COLUMN public_key TEXT NOT NULL DEFAULT ''")
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()

    def get(self, key: str, default: str | None = None) -> str | None:
        """A value of the meta table."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def put(self, key: str, value: str) -> None:
        """Set a value of the meta table."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def adopt_model(self, model: dict[str, Any], check: bool) -> list[tuple[str, Any, Any]]:
        """Record the run's [model] section; with `check` (resuming), first return (key, saved, given) for every key
        whose value differs from the saved run's, and record nothing if any does."""
        saved = json.loads(self.get(_MODEL_KEY) or "{}")
        if check and saved:
            differing = [(k, saved.get(k), model.get(k)) for k in sorted(saved.keys() | model.keys())]
            differing = [d for d in differing if d[1] != d[2]]
            if differing:
                return differing
        self.put(_MODEL_KEY, json.dumps(model))
        return []

    def commit_step(self, record: StepRecord, checksums: dict[int, str]) -> None:
        """Record a committed step (and clear its pending decision) in one transaction; a step is committed once."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM meta WHERE key = 'decided'")
            self._db.execute(
                "INSERT INTO steps VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.step,
                    record.loss,
                    record.val_loss,
                    record.tokens_per_s,
                    record.seconds,
                    record.plan_epoch,
                    json.dumps(checksums),
                    record.committed_at or time.time(),
                ),
            )

    def rollback_to(self, steps_done: int) -> None:
        """Forget the steps after `steps_done` (a rollback to an older checkpoint)."""
        with self._lock:
            self._db.execute("DELETE FROM steps WHERE step >= ?", (steps_done,))
            self._db.execute("DELETE FROM meta WHERE key = 'decided'")

    def committed_steps(self) -> int:
        """How many steps are committed."""
        with self._lock:
            row = self._db.execute("SELECT COUNT(*) FROM steps").fetchone()
        return int(row[0])

    def checksums(self, step: int) -> dict[int, str]:
        """Each stage's parameter checksum after `step`."""
        with self._lock:
            row = self._db.execute("SELECT checksums FROM steps WHERE step = ?", (step,)).fetchone()
        return {int(k): v for k, v in json.loads(row[0]).items()} if row else {}

    def rename_checksums(self, renamed: dict[str, str]) -> None:
        """Replace recorded stage checksums (`renamed`: old -> new) in every committed step, in one transaction."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            for step, text in self._db.execute("SELECT step, checksums FROM steps").fetchall():
                checksums = json.loads(text)
                converted = {stage: renamed.get(checksum, checksum) for stage, checksum in checksums.items()}
                if converted != checksums:
                    self._db.execute("UPDATE steps SET checksums = ? WHERE step = ?", (json.dumps(converted), step))

    def set_val_loss(self, step: int, val_loss: float) -> None:
        """Attach a validation loss to a committed step."""
        with self._lock:
            self._db.execute("UPDATE steps SET val_loss = ? WHERE step = ?", (val_loss, step))

    def steps(self) -> list[StepRecord]:
        """Every committed step, in order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT step, loss, val_loss, tokens_per_s, seconds, plan_epoch, committed_at FROM steps ORDER BY step"
            ).fetchall()
        return [StepRecord(*row) for row in rows]

    def upsert_member(self, node_id: str, address: str, region: str, state: str, public_key: bytes = b"") -> None:
        """Record a member and its state (alive, dead, evicted); the first public key recorded for an id stays."""
        with self._lock:
            self._db.execute(
                "INSERT INTO members (node_id, address, region, joined_at, state, public_key) "
                "VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(node_id) DO UPDATE SET address = excluded.address, region = excluded.region, "
                "state = excluded.state, "
                "public_key = CASE members.public_key WHEN '' THEN excluded.public_key ELSE members.public_key END",
                (node_id, address, region, time.time(), state, public_key.hex()),
            )

    def member_key(self, node_id: str) -> bytes | None:
        """The public key that owns a member's id (b"" when it registered without one); None for an unknown id."""
        with self._lock:
            row = self._db.execute("SELECT public_key FROM members WHERE node_id = ?", (node_id,)).fetchone()
        return bytes.fromhex(row[0]) if row else None

    def evicted(self, public_key: bytes) -> bool:
        """Whether a member registered with this key was evicted."""
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM members WHERE public_key = ? AND state = 'evicted' LIMIT 1", (public_key.hex(),)
            ).fetchone()
        return row is not None

    def event(self, kind: str, node_id: str = "", detail: str = "") -> None:
        """Append to the event log."""
        with self._lock:
            self._db.execute(
                "INSERT INTO events (at, kind, node_id, detail) VALUES (?, ?, ?, ?)", (time.time(), kind, node_id, detail)
            )

    def events(self, limit: int = 100) -> list[tuple[float, str, str, str]]:
        """The latest events, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT at, kind, node_id, detail FROM events ORDER BY id DESC LIMIT ?", (limit,)
            ).fetchall()
        return rows[::-1]
