"""The compression policy: a fixed codec per kind of traffic, or `auto`, which compresses only where it shortens the
time to a target loss.

`auto` predicts, for each codec of a ladder, the time to the target as (the link's pace per microbatch) x (the steps the
codec's loss costs): a stage is paced by the slower of its compute per microbatch and its link's transfer of a
microbatch's tensor, and a lossy codec needs more steps to the same loss. It takes the codec of the least predicted time,
but keeps the current one while it would be the fastest at some bandwidth within `margin` of the estimate, so an
estimate that wanders a little does not flip the choice. A compute-bound stage, or a link whose time is latency
(microbatches in flight overlap it, and no codec shortens it), keeps none. The sender decides from what it measured
itself (its link, its compute time); the receiver accepts any codec of the ladder, so the two need not agree.

STEPS_FACTOR prices each codec's loss: the steps to the target relative to none. bench/convergence.py measured,
after 40 steps against none: int8 +0.03% validation loss with 3.8x fewer bytes, topk:0.1 +0.3% with 6.3x fewer (its
rank-1 base: without it, +6.6%); over 30 steps of a run whose links mostly carried topk:0.1, training loss was 3.314
against none's 3.022 (issue #18), and a public WAN pipeline's entry that sent 6.4x fewer bytes needed 3.1x the steps.
The factors are those measurements rounded towards caution: top-k is taken only where its transfer is much shorter.
Top-k keeps no error feedback on these links (the data plane's choice: a residual would land on another
microbatch's sample). Replica gradients take a fixed codec only (the config allows none: see CompressionSection).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

import torch

from geotrain.compression.base import Codec, CodecError, get_codec

log = logging.getLogger(__name__)

AUTO = "auto"

LADDER = ("none", "fp16", "int8", "topk:0.1")
STEPS_FACTOR = {"none": 1.0, "fp16": 1.01, "int8": 1.05, "topk:0.1": 1.5}
AUTO_KINDS = ("activations", "activation_grads")


def check_spec(kind: str, spec: str) -> None:
    """Raise CodecError unless `spec` is a codec spec, or `auto` for a kind of traffic that has a ladder."""
    if spec.strip() == AUTO:
        if kind not in AUTO_KINDS:
            raise CodecError(f"'auto' is not available for {kind}; it works for {', '.join(AUTO_KINDS)}")
        return
    get_codec(spec)


def time_to_target(transfer_s: float, compute_s: float, steps_factor: float) -> float:
    """The predicted time to the target loss, relative to none's steps: the pipeline's pace per microbatch (the
    slower of compute and the link's transfer) times the steps the codec's loss costs."""
    return max(transfer_s, compute_s) * steps_factor


def choose(times_s: Sequence[Sequence[float]], current: int) -> int:
    """Index into a ladder given each codec's predicted time to the target under a few link bandwidths, the estimate's
    in the middle of a band around it: the codec fastest under the estimate, unless the current one is the fastest
    under some bandwidth of the band (hysteresis: an estimate that wanders within the band does not flip it)."""
    fastest = [min(range(len(times)), key=lambda i: (times[i], i)) for times in times_s]
    return current if current in fastest else fastest[len(fastest) // 2]


@dataclass(frozen=True)
class LinkEstimate:
    """What a link was measured to do."""

    bytes_per_s: float
    latency_s: float


_BYTES, _RETURNED = itemgetter(0), itemgetter(2)  # of a call (bytes, sent, returned)


class LinkEstimator:
    """Bandwidth and latency of one link from the calls it carried: bytes, when each was sent and when it returned.

    The link is a first-in first-out pipe: a message starts on the wire once it is sent and the one before it has
    left, occupies the wire for bytes / bandwidth, and its call returns a latency after that. Given the latency, a
    call's occupancy is exact whether it waited behind others or found the link idle (the wait and the latency are
    not the link's bandwidth: counting them measured a steady 48 Mbit/s link at 15-247 Mbit/s), and the bandwidth is
    a window's bytes over its occupancy, a ratio of sums that one call's jitter moves little. The latency is the least
    call time less its bytes / bandwidth (waiting only adds time), at least half the least round trip of empty
    probes (`probed`); the two are solved together by a few rounds of fixed point, and smoothed across calls. A link whose
    calls never overlap and all carry one size cannot tell its latency from its bandwidth without a probe: its
    latency counts as bandwidth, which errs towards compressing.

    The window is refitted at its first call and then once every `refit` calls, the smoothing weighing the fit as
    that many calls' fits: consecutive windows share all but a call, and a fit on every call was a tenth of a raw
    tensor stream's CPU above a raw socket's (bench/tensor_path.py; a node sends a tensor per call).
    """

    def __init__(self, window: int = 32, alpha: float = 0.2, rounds: int = 6, refit: int = 8) -> None:
        self.alpha, self.rounds, self.refit = alpha, rounds, refit
        self._calls: deque[tuple[int, float, float]] = deque(maxlen=window)  # (bytes, sent, returned)
        self._latency_floor = 0.0
        self._smoothed: LinkEstimate | None = None
        self._unfitted = 0  # calls since the last fit

    def probed(self, round_trip_s: float) -> None:
        """Record an empty probe's round trip: half the least one bounds a call's latency from below (a probe can
        only be slowed, by messages queued ahead of it)."""
        half = round_trip_s / 2
        self._latency_floor = half if self._latency_floor == 0 else min(self._latency_floor, half)

    def observe(self, nbytes: int, sent: float, returned: float) -> None:
        """Record a call that carried nbytes, sent at `sent` (before any emulated delay) and answered at `returned`
        (monotonic seconds)."""
        if returned <= sent or nbytes <= 0:
            return
        self._calls.append((nbytes, sent, returned))
        self._unfitted += 1
        if self._smoothed is not None and self._unfitted < self.refit:
            return
        fitted = self._fit()
        if fitted is None:
            return
        old, a = self._smoothed, 1 - (1 - self.alpha) ** self._unfitted
        self._unfitted = 0
        self._smoothed = fitted if old is None else LinkEstimate(
            (1 - a) * old.bytes_per_s + a * fitted.bytes_per_s, (1 - a) * old.latency_s + a * fitted.latency_s
        )

    def _fit(self) -> LinkEstimate | None:
        """Bandwidth and latency of the window's calls, as the class docstring says."""
        calls = sorted(self._calls, key=_RETURNED)
        total = sum(map(_BYTES, calls))
        latency, bytes_per_s = self._latency_floor, 0.0
        # It runs every few calls a node sends: the loops are plain comparisons (builtin max calls made it 2.5x slower,
        # and a generator is a frame), and rounds stop at a fixed point (a latency that a round leaves unchanged,
        # every later round would too).
        for _ in range(self.rounds):
            occupied, left = 0.0, -math.inf
            for n, sent, returned in calls:
                end = returned - latency
                start = sent if sent > left else left
                if end > start:
                    occupied += end - start
                if end > left:
                    left = end
            if occupied <= 0:
                return None
            bytes_per_s = total / occupied
            floor = math.inf
            for n, sent, returned in calls:
                waited = returned - sent - n / bytes_per_s
                if waited < floor:
                    floor = waited
            settled = max(self._latency_floor, floor, 0.0)
            if settled == latency:
                break
            latency = settled
        return LinkEstimate(bytes_per_s, latency)

    def estimate(self) -> LinkEstimate | None:
        """The link's bandwidth and latency, or None before its first call."""
        return self._smoothed


class StageTimer:
    """Smoothed compute seconds per microbatch of a stage: its forward plus its backward task."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._mean: dict[str, float] = {}

    def observe(self, kind: str, seconds: float) -> None:
        """Record one task of `kind` ("forward" or "backward")."""
        old = self._mean.get(kind)
        self._mean[kind] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def per_microbatch(self) -> float | None:
        """Seconds of compute per microbatch, or None before the first forward (the last stage has no backward)."""
        if "forward" not in self._mean:
            return None
        return sum(self._mean.values())


class CodecPolicy:
    """The codec for one kind of traffic, per link: fixed, or chosen by `auto` from each link's measurements."""

    def __init__(self, kind: str, spec: str, margin: float = 0.15, dwell: int = 8) -> None:
        check_spec(kind, spec)
        self.kind = kind
        self.auto = spec.strip() == AUTO
        self.ladder: tuple[Codec, ...] = tuple(get_codec(s) for s in LADDER) if self.auto else (get_codec(spec),)
        self.margin, self.dwell = margin, dwell
        self._current: dict[str, int] = {}
        self._since_switch: dict[str, int] = {}

    @property
    def accepted_ids(self) -> frozenset[int]:
        """Codec ids a receiver of this traffic accepts."""
        return frozenset(c.codec_id for c in self.ladder)

    def codec(
        self,
        link: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        estimate: LinkEstimate | None,
        compute_s: float | None,
    ) -> Codec:
        """The codec for the next tensor of `shape` on `link`."""
        current = self._current.get(link, 0)
        if not self.auto or estimate is None or compute_s is None:
            return self.ladder[current]
        seen = self._since_switch.get(link, 0) + 1
        self._since_switch[link] = seen
        # Calls made before a switch still report the old codec's size: let the new one be measured first.
        if seen < self.dwell:
            return self.ladder[current]
        encoded = [c.encoded_nbytes(tuple(shape), dtype) for c in self.ladder]
        factors = [STEPS_FACTOR[spec] for spec in LADDER]
        bands = [estimate.bytes_per_s * f for f in (1 - self.margin, 1.0, 1 + self.margin)]
        times = [
            [time_to_target(n / b if b > 0 else math.inf, compute_s, f) for n, f in zip(encoded, factors, strict=True)]
            for b in bands
        ]
        chosen = choose(times, current)
        transfers = [n / estimate.bytes_per_s if estimate.bytes_per_s > 0 else math.inf for n in encoded]
        if chosen != current:
            log.info(
                "%s to %s: %s -> %s (link %.2f Mbit/s, %.0f ms; transfer %.1f ms -> %.1f ms; compute %.1f ms)",
                self.kind, link, self.ladder[current].name, self.ladder[chosen].name,
                estimate.bytes_per_s * 8e-6, estimate.latency_s * 1e3, transfers[current] * 1e3,
                transfers[chosen] * 1e3, compute_s * 1e3,
            )
            self._current[link] = chosen
            self._since_switch[link] = 0
        return self.ladder[chosen]
