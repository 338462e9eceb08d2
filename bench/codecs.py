"""Codec figures on tensors shaped like real activations and gradients: one JSON line per (data, codec).

ratio is raw bytes over payload bytes; rel_error is ||x - decode(encode(x))|| / ||x|| for one message with
fresh state; encode_gbps and decode_gbps are raw (fp32) bytes per second, timed in steady state (error
feedback codecs carry their state across repetitions). memcpy_gbps is the physical reference: copying the same
tensor into a preallocated tensor of its size (dst.copy_(x)), which reads and writes every byte once and, unlike
clone, neither allocates nor faults in fresh pages, so it does not swing with the allocator's behaviour; a tensor
that fits in the caches is copied at cache speed. Everything runs with torch's threads set to the CPU count.
Each time is the fastest of a few repetitions after WARMUP_S of warm-up runs (one warm-up run measured the
activation's copy at 28 GB/s where it settles at 45-65 GB/s). On a shared machine other processes only ever add
time, and with torch's threads on every core one descheduled thread stalls a whole parallel pass, so a median
measures the neighbours; the fastest run is the closest to what the code costs, for the reference and the codecs
alike. implementation says what ran: "c" for int8's C kernel (built by setup.py where a compiler is found), "torch"
for everything else and for int8 without the kernel. Run: python bench/codecs.py [--codecs int8,none]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch

from geotrain.compression import codecs, get_codec

SPECS = ["none", "fp16", "bf16", "int8", "int8:block=128", "int4", "topk:0.1", "topk:0.01", "powersgd:rank=4"]
REPEATS = 7
WARMUP_S = 0.2


def _fastest_seconds(fn: Callable[[], object]) -> float:
    """Fastest wall time of `fn` over REPEATS runs, after running it for WARMUP_S (at least once)."""
    warm_until = time.perf_counter() + WARMUP_S
    fn()
    while time.perf_counter() < warm_until:
        fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _datasets() -> list[tuple[str, torch.Tensor]]:
    """Activations (batch x seq x hidden) and gradients (hidden x hidden), normal and heavy-tailed."""
    g = torch.Generator().manual_seed(0)
    activation = torch.randn(8, 128, 1024, generator=g)
    gradient = torch.randn(4096, 4096, generator=g)
    # Student-t with 2 degrees of freedom: a normal over the root of an independent chi-square / 2.
    chi2 = torch.randn(2, 4096, 4096, generator=g).square().sum(0)
    heavy = torch.randn(4096, 4096, generator=g) / (chi2 / 2).sqrt() * 1e-3
    return [("activation", activation), ("gradient", gradient), ("gradient_heavy_tailed", heavy)]


def _figures(spec: str, data: str, x: torch.Tensor, memcpy_s: float) -> dict[str, object]:
    """One JSON record for codec `spec` on tensor `x`."""
    codec = get_codec(spec)
    payload = codec.encode(x, codec.new_state())
    y = codec.decode(payload, x.shape, x.dtype)
    state = codec.new_state()
    encode_s = _fastest_seconds(lambda: codec.encode(x, state))
    decode_s = _fastest_seconds(lambda: codec.decode(payload, x.shape, x.dtype))
    gb = x.numel() * x.element_size() / 1e9
    return {
        "codec": codec.name,
        "data": data,
        "shape": list(x.shape),
        "ratio": round(x.numel() * x.element_size() / len(payload), 3),
        "rel_error": float(f"{float((x - y).norm() / x.norm()):.4g}"),
        "encode_gbps": round(gb / encode_s, 3),
        "decode_gbps": round(gb / decode_s, 3),
        "memcpy_gbps": round(gb / memcpy_s, 3),
        "implementation": "c" if codec.base_name == "int8" and codecs._blockquant is not None else "torch",
    }


def main() -> None:
    """Print the figures of every codec on every data set."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default=",".join(SPECS), help=f"comma-separated (default {','.join(SPECS)})")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    for data, x in _datasets():
        dst = torch.empty_like(x)
        memcpy_s = _fastest_seconds(lambda: dst.copy_(x))
        for spec in args.codecs.split(","):
            print(json.dumps(_figures(spec, data, x, memcpy_s)), flush=True)


if __name__ == "__main__":
    main()
