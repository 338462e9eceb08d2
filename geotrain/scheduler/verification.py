"""Verified compute, the coordinator's side: commitments cross-checked between the two ends of every hop, spot checks
drawn once a step's commitments are in (and told with the step's apply: to their targets, so that only they keep
evidence, and to their verifiers, who report with their next GradNorm), disputes settled by a second verifier, and
the verdicts the run loop acts on (evict whoever was wrong, roll back to before its first planned step).

A stage on one device class is bit-exact, so a recompute from the same parameters and inputs gives the same bits:
one differing digest is proof. The coordinator runs no model code; it compares digests (node/verifier.py computes
them). State lives under the membership's condition; the functions above the class are pure."""

from __future__ import annotations

import itertools
import logging
import random
import secrets
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.errors import ReportRefused
from geotrain.scheduler.membership import Member
from geotrain.scheduler.profiles import device_class as profile_class

log = logging.getLogger(__name__)

DeviceClass = str  # scheduler.profiles.device_class: bit-exact within one
_FIELDS = ("received", "received_grad", "sent", "sent_grad", "param_grads")


def device_class(member: Member) -> DeviceClass | None:
    """The class a member computes bit-identically with, the one the planner keeps a stage's replicas to (torch build
    included: a verifier on another build may round otherwise and accuse an honest node); None before its profile."""
    profile = member.profile
    if profile is None or not profile.device:
        return None
    return profile_class(profile)


@dataclass(frozen=True)
class Disagreement:
    """Two ends of a hop committed to different tensors (or one committed to none, or a stage to other parameters
    than the run recorded): `nodes` are who may have lied."""

    microbatch: int
    nodes: tuple[str, ...]
    what: str


def cross_check(
    paths: dict[int, list[str]],
    commitments: dict[str, dict[int, pb.MicrobatchCommitment]],
    params_before: dict[str, str],
    recorded: dict[str, str],
) -> list[Disagreement]:
    """Every hop of every microbatch: the sender's digest of what it sent equals the receiver's of what it received,
    forward (activations) and backward (gradients); every node on a path committed to the microbatch; and each node's
    parameters before the step are the ones recorded for its stage (`recorded`: node -> checksum; absent: none)."""
    found: list[Disagreement] = []
    for node, checksum in sorted(recorded.items()):
        if params_before.get(node, "") != checksum:
            found.append(Disagreement(-1, (node,), "parameters before the step differ from the recorded checksum"))
    for mb, path in sorted(paths.items()):
        ends = [commitments.get(n, {}).get(mb) for n in path]
        missing = tuple(n for n, c in zip(path, ends) if c is None)
        if missing:
            found.append(Disagreement(mb, missing, "no commitment"))
            continue
        for (a, ca), (b, cb) in itertools.pairwise(zip(path, ends)):
            if ca.sent != cb.received:
                found.append(Disagreement(mb, (a, b), f"activations {a} -> {b}"))
            if cb.sent_grad != ca.received_grad:
                found.append(Disagreement(mb, (b, a), f"gradient {b} -> {a}"))
    return found


def draw(pairs: Iterable[tuple[int, int]], fraction: float, rng: random.Random) -> list[tuple[int, int]]:
    """Each (stage, microbatch) pair independently with probability `fraction`."""
    return [p for p in pairs if rng.random() < fraction]


def compare(committed: pb.MicrobatchCommitment, params: str, report: pb.VerifyReport) -> str:
    """Where a verifier's recompute differs from the target's commitment ("" where it agrees bit for bit)."""
    if report.error:
        return f"no recompute: {report.error}"
    if report.params_checksum != params:
        return "the parameters served are not the ones committed"
    differ = [f for f in _FIELDS if getattr(report.digests, f) != getattr(committed, f)]
    return f"{', '.join(differ)} differ" if differ else ""


@dataclass(frozen=True)
class Check:
    """One recompute ordered from `verifier`; a dispute's second check carries the first verifier's accusation."""

    id: int
    step: int
    stage: int
    microbatch: int
    layers: tuple[int, int]
    target: str
    target_address: str
    committed: pb.MicrobatchCommitment
    params: str
    verifier: str
    candidates: tuple[str, ...]  # the nodes of the target's device class that may verify it
    accuser: str = ""
    accusation: str = ""

    def order(self) -> pb.VerifyOrder:
        """The order the verifier gets."""
        return pb.VerifyOrder(
            check=self.id, step=self.step, microbatch=self.microbatch, layer_start=self.layers[0],
            layer_end=self.layers[1], target=self.target, target_address=self.target_address,
        )

    def draw(self) -> pb.CheckDraw:
        """The check as the step's apply tells it: its target keeps the evidence, its verifier takes the order."""
        return pb.CheckDraw(stage=self.stage, microbatch=self.microbatch, verifier=self.verifier, order=self.order())


@dataclass(frozen=True)
class Verdict:
    """A settled dispute: `guilty` computed wrong (or accused falsely) and goes."""

    guilty: str
    why: str
    step: int  # the step of the work checked


@dataclass
class VerifyCounts:
    """What status shows of the checks."""

    checks: int = 0
    mismatches: int = 0
    unserved: int = 0
    evicted: int = 0
    seconds: float = 0.0
    commitments_refused: int = 0

    def as_proto(self) -> pb.VerifyStatus:
        """The status message."""
        return pb.VerifyStatus(
            checks=self.checks, mismatches=self.mismatches, unserved=self.unserved, evicted=self.evicted,
            seconds=self.seconds, commitments_refused=self.commitments_refused,
        )


def choose(
    candidates: Iterable[str], exclude: set[str], load: Counter[str], distance: Callable[[str], int] = lambda n: 0
) -> str | None:
    """The candidate nearest by `distance`, then with the fewest checks so far (then by id), outside `exclude`; None
    if none is left."""
    left = sorted((n for n in candidates if n not in exclude), key=lambda n: (distance(n), load[n], n))
    return left[0] if left else None


@dataclass
class Verification:
    """The coordinator's spot checks and disputes, under the membership's condition."""

    fraction: float
    rng: random.Random = field(default_factory=secrets.SystemRandom)  # a draw no node can predict
    first_planned: dict[str, int] = field(default_factory=dict)  # node -> the first step it was planned on
    pending: dict[int, Check] = field(default_factory=dict)
    verdicts: list[Verdict] = field(default_factory=list)
    counts: VerifyCounts = field(default_factory=VerifyCounts)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _load: Counter[str] = field(default_factory=Counter)

    def planned(self, step: int, nodes: Iterable[str]) -> None:
        """Nodes planned on `step`: what a verdict against one rolls back to is before the first such step."""
        for n in nodes:
            self.first_planned.setdefault(n, step)

    def draw_checks(
        self,
        step: int,
        plan: pb.Plan,
        paths: dict[int, list[str]],
        commitments: dict[str, dict[int, pb.MicrobatchCommitment]],
        params_before: dict[str, str],
        classes: dict[str, DeviceClass | None],
    ) -> list[Check]:
        """The checks of a step whose commitments are all in (issue() them as its apply goes out): a fraction of its
        (stage, microbatch) pairs, each given to a node of the
        target's device class other than the target (pairs whose target has no such node go unchecked): a replica of
        the target's stage first, else a node of the stage after it (cyclically), and so on, so that a verifier keeps
        checking the same layers, whose runtime it keeps (building one, as for a stage with embeddings, can cost more
        than the recompute), and the checks of each stage fall to the nodes of one other."""
        checks = []
        pairs = [(s.index, mb) for s in plan.stages for mb in sorted(paths)]
        stage_of = {n: s.index for s in plan.stages for n in s.node_ids}
        for stage_index, mb in draw(pairs, self.fraction, self.rng):
            stage = plan.stages[stage_index]
            target = paths[mb][stage_index]
            cls = classes.get(target)
            candidates = tuple(n for n, c in classes.items() if c is not None and c == cls and n != target)
            verifier = choose(
                candidates, set(), self._load, lambda n: (stage_of.get(n, stage_index) - stage_index) % len(plan.stages)
            )
            if verifier is None:
                continue
            address = stage.addresses[list(stage.node_ids).index(target)]
            check = Check(
                id=next(self._ids), step=step, stage=stage_index, microbatch=mb,
                layers=(stage.layer_start, stage.layer_end), target=target, target_address=address,
                committed=commitments[target][mb], params=params_before.get(target, ""), verifier=verifier,
                candidates=candidates,
            )
            self._load[verifier] += 1
            checks.append(check)
        return checks

    def issue(self, checks: Iterable[Check]) -> None:
        """Checks about to go out with their step's apply (their targets keep the evidence, their verifiers take the
        orders): their reports are awaited."""
        self.pending.update((check.id, check) for check in checks)

    def report(self, report: pb.VerifyReport) -> Check | None:
        """A verifier's result; returns the dispute's second check when it accuses the target (None otherwise).
        ReportRefused for a check this coordinator did not give the reporter."""
        check = self.pending.get(report.check)
        if check is None or check.verifier != report.node_id:
            raise ReportRefused(f"verify report from {report.node_id} refused: check {report.check} is not its")
        del self.pending[report.check]
        self.counts.checks += 1
        self.counts.seconds += max(0.0, min(report.seconds, 86400.0))
        differs = compare(check.committed, check.params, report)
        if report.error:
            self.counts.unserved += 1
        where = f"step {check.step} stage {check.stage} microbatch {check.microbatch} of {check.target}"
        if not check.accuser:
            if not differs:
                return None
            self.counts.mismatches += 1
            second = choose(check.candidates, {check.target, report.node_id}, self._load)
            log.warning("%s accuses %s: %s", report.node_id, where, differs)
            if second is None:
                log.warning("%s: no second verifier of its device class to settle it; left unresolved", where)
                return None
            dispute = replace(check, id=next(self._ids), verifier=second, accuser=report.node_id, accusation=differs)
            self._load[second] += 1
            self.pending[dispute.id] = dispute
            return dispute
        if differs:
            self.counts.mismatches += 1
            why = f"{where}: {check.accuser} and {report.node_id} recomputed otherwise ({differs})"
            self.verdicts.append(Verdict(check.target, why, check.step))
        else:
            why = f"{where}: {check.accuser} accused it falsely ({check.accusation}); {report.node_id} recomputed it equal"
            self.verdicts.append(Verdict(check.accuser, why, check.step))
        return None

    def reports(self, verifier: str, reports: Sequence[pb.VerifyReport]) -> list[Check]:
        """A verifier's reports, as its GradNorm brings them; returns the disputes they open. ReportRefused when one is
        another node's. Reports of checks no longer awaited are dropped, not refused (a GradNorm sent again after its
        answer was lost carries its reports again; a coordinator restarted since knows none of its checks), and so,
        unread, are more reports than the checks it was ever given."""
        if any(r.node_id != verifier for r in reports):
            raise ReportRefused(f"verify reports from {verifier} refused: not its own")
        if len(reports) > self._load[verifier]:
            log.info("%d verify reports from %s dropped: it was given %d checks", len(reports), verifier,
                     self._load[verifier])
            return []
        disputes = []
        for report in reports:
            try:
                dispute = self.report(report)
            except ReportRefused as e:
                log.info("%s", e)
                continue
            if dispute is not None:
                disputes.append(dispute)
        return disputes

    def take_verdicts(self) -> list[Verdict]:
        """The verdicts since the last call."""
        verdicts, self.verdicts = self.verdicts, []
        return verdicts
