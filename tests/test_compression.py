"""geotrain.compression: round-trip error bounds, NaN/Inf semantics, error feedback, hostile payloads."""

from __future__ import annotations

import math
import shutil
import sysconfig
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geotrain.compression import (
    CODEC_IDS,
    Codec,
    CodecError,
    FeedbackState,
    TopKCodec,
    codec_from_payload,
    get_codec,
)
from geotrain.compression import codecs as codecs_module
from geotrain.compression.base import HEADER, MAGIC, VERSION

# base.py ignores it too: decoders read payload bytes in place (peek_body) and never write through them.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")

SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8:block=128",
    "int8:block=7",
    "int4",
    "int4:block=16",
    "topk:0.1",
    "topk:0.5",
    "powersgd:rank=4",
    "powersgd:rank=1",
]
LOSSY_CHECKED = ["int8", "int4", "topk:0.1", "powersgd:rank=2"]
# Every codec but none (raw bytes) puts a header in front of its payload.
HEADERED = [s for s in SPECS if s != "none"]
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
F16_MAX = torch.finfo(torch.float16).max
FAST = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def float_tensors(draw: st.DrawFn, max_scale: float = 1e30) -> torch.Tensor:
    """Tensors of awkward shapes and values: zeros, tiny, huge, negative, single elements, outliers."""
    dtype = draw(st.sampled_from(FLOATS))
    if draw(st.booleans()):
        values = draw(st.lists(st.floats(-1e4, 1e4, width=16), min_size=1, max_size=70))
        return torch.tensor(values, dtype=torch.float32).to(dtype)
    shape = tuple(draw(st.lists(st.integers(1, 37), min_size=0, max_size=3)))
    kind = draw(st.sampled_from(["normal", "zeros", "constant", "positive", "negative", "outliers"]))
    scales = [s for s in (1e-38, 1e-30, 1e-6, 1.0, 1e3, 1e30) if s <= min(max_scale, torch.finfo(dtype).max / 1e3)]
    scale = draw(st.sampled_from(scales))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "zeros":
        x.zero_()
    elif kind == "constant":
        x.fill_(-1.5)
    elif kind == "positive":
        x.abs_()
    elif kind == "negative":
        x = -x.abs()
    elif kind == "outliers":
        x *= torch.where(torch.rand(shape, generator=g, dtype=torch.float64) < 0.02, 1e4, 1.0)
    return (x * scale).to(dtype)


def _slack(dtype: torch.dtype) -> float:
    """Half the spacing of `dtype` near zero: what casting the decoded float32 back can lose absolutely."""
    info = torch.finfo(dtype)
    return info.tiny * info.eps


def _block_bound(x: torch.Tensor, block: int, qmax: int) -> torch.Tensor:
    """Per-element bound of blockwise absmax rounding: half a step, plus the output dtype's rounding."""
    flat = x.double().reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)
    absmax = padded.abs().amax(1, keepdim=True).clamp(min=qmax * 2.0**-120)
    step = (absmax / qmax).expand_as(padded).reshape(-1)[: flat.numel()]
    rounding = 2 * torch.finfo(x.dtype).eps + 2 * torch.finfo(torch.float32).eps
    return 0.5 * step * (1 + 1e-5) + rounding * flat.abs() + _slack(x.dtype)


def _roundtrip(codec: Codec, x: torch.Tensor, state: FeedbackState | None = None) -> torch.Tensor:
    payload = codec.encode(x, state)
    assert len(payload) <= codec.encoded_nbytes(tuple(x.shape), x.dtype)
    y = codec_from_payload(codec.codec_id, payload).decode(payload, x.shape, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype
    return y


# ---------------------------------------------------------------------------------------------------------
# API and specs


@pytest.mark.timeout(30)
def test_codec_ids_are_the_wire_contract() -> None:
    assert CODEC_IDS == {"none": 1, "fp16": 2, "bf16": 3, "int8": 4, "int4": 5, "topk": 6, "powersgd": 7}
    for spec in SPECS:
        codec = get_codec(spec)
        assert codec.codec_id == CODEC_IDS[spec.split(":")[0]]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("none", "none"),
        ("int8", "int8:block=64"),
        ("int8:block=128", "int8:block=128"),
        ("int4", "int4:block=64"),
        ("topk:0.1", "topk:0.1"),
        ("topk:1e-06", "topk:1e-06"),
        ("topk:1", "topk:1"),
        ("powersgd", "powersgd:rank=4"),
        (" powersgd:rank=8 ", "powersgd:rank=8"),
    ],
)
def test_names_are_canonical(spec: str, name: str) -> None:
    assert get_codec(spec).name == name
    assert get_codec(name).name == name


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "spec",
    ["", "int9", "int8:block=0", "int8:block=1", "int8:block=abc", "int8:blk=64", "int8:block=2097152",
     "int4:block=63", "topk", "topk:0", "topk:1.5", "topk:nan", "topk:-0.1", "topk:1e-9", "topk:x",
     "powersgd:rank=0", "powersgd:rank=2000", "powersgd:4", "none:3", "fp16:block=64"],
)
def test_bad_specs_raise_codec_error(spec: str) -> None:
    with pytest.raises(CodecError):
        get_codec(spec)


def test_codec_errors_are_value_errors() -> None:
    # Config validation reports ValueErrors as bad values; a bad codec spec must be one of them.
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("zip")


@pytest.mark.timeout(30)
def test_get_codec_rejects_non_strings() -> None:
    with pytest.raises(CodecError):
        get_codec(4)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 0, 2), (5, 13), (64, 64), (2, 3, 50)])
def test_payload_size_is_encoded_nbytes(spec: str, shape: tuple[int, ...]) -> None:
    codec = get_codec(spec)
    x = torch.randn(shape)
    payload = codec.encode(x, codec.new_state())
    bound = codec.encoded_nbytes(shape, x.dtype)
    if spec.startswith("topk"):
        assert HEADER.size <= len(payload) <= bound
    else:
        assert len(payload) == bound
    assert _roundtrip(codec, x).shape == shape


# Payload bytes of float32 tensors worked out by hand from each format (a 24-byte header in front of all but none).
SIZES = [
    ("none", (5, 13), 65 * 4),
    ("fp16", (5, 13), 24 + 65 * 2),
    ("bf16", (64, 64), 24 + 4096 * 2),
    ("int8", (5, 13), 24 + 2 * 4 + 65),  # two blocks of 64: two float32 scales, a byte per value
    ("int8:block=7", (5, 13), 24 + 10 * 4 + 65),
    ("int4", (64, 64), 24 + 64 * 4 + 4096 // 2),  # two values per byte
    ("int4:block=16", (5, 13), 24 + 5 * 4 + 32 + 1),  # 64 values in 32 bytes, the odd one in a byte of its own
    ("topk:0.1", (5, 13), 24 + 6 * 7),  # 7 of 65 kept (index + fp16 value); a base would cost more than they do
    ("topk:0.1", (64, 64), 24 + 4 * (64 + 64) + 6 * 410),  # 410 of 4096 kept, with the rank-1 base
    ("topk:0.5", (2, 3, 50), 24 + 4 * (6 + 50) + 6 * 150),
    ("powersgd:rank=4", (64, 64), 24 + 4 * 4 * (64 + 64)),
    ("powersgd:rank=4", (5, 13), 24 + 65 * 4),  # rank 4 factors (72 values) outweigh the 65 raw ones
    ("powersgd:rank=1", (5, 13), 24 + 4 * (5 + 13)),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("spec", "shape", "nbytes"), SIZES)
def test_encoded_nbytes_by_hand(spec: str, shape: tuple[int, ...], nbytes: int) -> None:
    codec = get_codec(spec)
    assert HEADER.size == 24
    assert codec.encoded_nbytes(shape, torch.float32) == nbytes
    payload = codec.encode(torch.randn(shape), codec.new_state())
    assert len(payload) <= nbytes if spec.startswith("topk") else len(payload) == nbytes


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool, torch.float64])
def test_none_carries_any_dtype_bit_exactly(dtype: torch.dtype) -> None:
    x = torch.randint(-100, 100, (3, 17)).to(dtype)
    assert torch.equal(_roundtrip(get_codec("none"), x), x)


def test_none_s_payload_is_the_tensor_s_own_memory_not_a_copy() -> None:
    x = torch.randn(3, 17)
    payload = get_codec("none").encode(x)
    x[0, 0] = 7.0
    assert bytes(payload) == x.numpy().tobytes()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", [s for s in SPECS if s != "none"])
def test_lossy_codecs_reject_integer_dtypes(spec: str) -> None:
    codec = get_codec(spec)
    with pytest.raises(CodecError):
        codec.encode(torch.ones(4, dtype=torch.int64))
    with pytest.raises(CodecError):
        codec.decode(get_codec(spec).encode(torch.ones(4)), (4,), torch.int64)


@pytest.mark.timeout(30)
def test_encode_rejects_wrong_argument_types() -> None:
    with pytest.raises(TypeError):
        get_codec("int8").encode([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        get_codec("topk:0.1").encode(torch.ones(4), state={})  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_state_only_for_error_feedback_codecs() -> None:
    for spec in SPECS:
        state = get_codec(spec).new_state()
        assert (state is not None) == spec.startswith(("topk", "powersgd"))


@pytest.mark.timeout(30)
def test_non_contiguous_input() -> None:
    x = torch.randn(40, 30).T
    for spec in SPECS:
        y = _roundtrip(get_codec(spec), x)
        assert y.is_contiguous()
    assert torch.equal(_roundtrip(get_codec("none"), x), x)


# ---------------------------------------------------------------------------------------------------------
# Round-trip error bounds


@pytest.mark.timeout(60)
@FAST
@given(x=float_tensors())
def test_none_is_exact(x: torch.Tensor) -> None:
    assert torch.equal(_roundtrip(get_codec("none"), x), x)


@pytest.mark.timeout(60)
@FAST
@given(x=float_tensors(), spec=st.sampled_from(["fp16", "bf16"]))
def test_half_casts_round_once_and_saturate(x: torch.Tensor, spec: str) -> None:
    codec = get_codec(spec)
    wire = torch.float16 if spec == "fp16" else torch.bfloat16
    fmax = torch.finfo(wire).max
    y = _roundtrip(codec, x)
    expected = x.to(wire)
    overflow = expected.isinf()
    expected[overflow] = (x[overflow].double().sign() * fmax).to(wire)
    assert torch.equal(y, expected.to(x.dtype))
    assert bool(torch.isfinite(y).all())


@pytest.mark.timeout(60)
@FAST
@given(x=float_tensors(), spec=st.sampled_from(["int8", "int8:block=7", "int8:block=128", "int4", "int4:block=16"]))
def test_blockwise_error_is_at_most_half_a_step(x: torch.Tensor, spec: str) -> None:
    codec = get_codec(spec)
    qmax = 127 if spec.startswith("int8") else 7
    y = _roundtrip(codec, x)
    err = (y.double() - x.double()).abs().reshape(-1)
    assert bool((err <= _block_bound(x, codec.param, qmax)).all())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", ["int8", "int4:block=16"])
@pytest.mark.parametrize("numel", [1, 255, 256, 4097, 5000])
def test_blockwise_chunking(monkeypatch: pytest.MonkeyPatch, spec: str, numel: int) -> None:
    # A tiny chunk exercises the torch path's loop over chunks (and its last partial chunk) with small tensors.
    monkeypatch.setattr(codecs_module, "_CHUNK", 256)
    monkeypatch.setattr(codecs_module, "_blockquant", None)
    codec = get_codec(spec)
    x = torch.randn(numel) * torch.logspace(-3, 3, numel)
    y = _roundtrip(codec, x)
    qmax = 127 if spec.startswith("int8") else 7
    assert bool(((y - x).abs().double() <= _block_bound(x, codec.param, qmax)).all())


# int8's C kernel (geotrain/compression/_blockquant.c) must write what the torch path writes, byte for byte.
needs_kernel = pytest.mark.skipif(codecs_module._blockquant is None, reason="the int8 C kernel is not built")


def _both_paths(spec: str, x: torch.Tensor) -> tuple[tuple[bytes, torch.Tensor], tuple[bytes, torch.Tensor]]:
    """(payload, decoded) of `x` by the C kernel and by the torch path."""
    codec = get_codec(spec)
    kernel = bytes(codec.encode(x))
    kernel_decoded = codec.decode(kernel, x.shape, x.dtype)
    with mock.patch.object(codecs_module, "_blockquant", None):
        torch_path = bytes(codec.encode(x))
        torch_decoded = codec.decode(torch_path, x.shape, x.dtype)
    return (kernel, kernel_decoded), (torch_path, torch_decoded)


@needs_kernel
@pytest.mark.timeout(60)
@FAST
@given(x=float_tensors(), spec=st.sampled_from(["int8", "int8:block=7", "int8:block=128", "int8:block=2"]))
def test_int8_kernel_writes_the_torch_paths_bytes(x: torch.Tensor, spec: str) -> None:
    (kernel, kernel_decoded), (torch_path, torch_decoded) = _both_paths(spec, x)
    assert kernel == torch_path
    assert torch.equal(kernel_decoded, torch_decoded)


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_int8_kernel_threads_split_blocks_exactly(threads: int) -> None:
    # Large enough for several threads, with a partial last block; values from subnormal to near float32's max.
    n = (1 << 19) + 37
    g = torch.Generator().manual_seed(threads)
    x = torch.randn(n, generator=g) * torch.logspace(-40, 37, n).float()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        (kernel, kernel_decoded), (torch_path, torch_decoded) = _both_paths("int8", x)
    finally:
        torch.set_num_threads(previous)
    assert kernel == torch_path
    assert torch.equal(kernel_decoded, torch_decoded)


@needs_kernel
@pytest.mark.timeout(30)
@pytest.mark.parametrize("position", [0, (1 << 18) + 1, (1 << 19) - 1])
@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_int8_kernel_finds_non_finite_values_in_every_threads_share(position: int, bad: float) -> None:
    x = np.ones(1 << 19, np.float32)
    x[position] = bad
    assert codecs_module._blockquant.int8_encode(x, 64, 0, 4) is None
    x[position] = 1.0
    assert len(codecs_module._blockquant.int8_encode(x, 64, 24, 4)) == 24 + len(x) // 64 * 4 + len(x)


@needs_kernel
@pytest.mark.timeout(30)
def test_int8_kernel_checks_its_arguments() -> None:
    x = np.ones(100, np.float32)
    for block, offset, values in ((0, 0, x), (64, -1, x), (64, 0, x.view(np.uint8)[:7])):
        with pytest.raises(ValueError, match="block must be positive"):
            codecs_module._blockquant.int8_encode(values, block, offset, 1)
    with pytest.raises(ValueError, match="do not fit"):
        codecs_module._blockquant.int8_decode(np.empty(100, np.int8), np.empty(2, np.float32), 64, x[:99], 1)
    with pytest.raises(TypeError):
        codecs_module._blockquant.int8_decode(np.empty(100, np.int8), np.empty(2, np.float32), 64, b"read-only", 1)


@pytest.mark.timeout(30)
def test_int8_kernel_is_built_where_a_compiler_is() -> None:
    # setup.py builds it optionally: without this, a broken build would silently leave every node on the slow path.
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) on this machine")
    assert codecs_module._blockquant is not None


@pytest.mark.timeout(60)
@FAST
@given(x=float_tensors(), spec=st.sampled_from(["topk:0.1", "topk:0.5", "topk:1"]))
def test_topk_sends_rounded_deviations_from_its_base_within_budget(x: torch.Tensor, spec: str) -> None:
    codec = get_codec(spec)
    assert isinstance(codec, TopKCodec)
    payload = codec.encode(x)
    base, idx, values = codec.parts(payload, x.shape)
    y = _roundtrip(codec, x).reshape(-1)
    assert idx.numel() <= codec.max_count(x.numel())
    if codec.base_dims(tuple(x.shape)) is None:
        assert not bool(base.any())
    # Kept entries carry their deviation from the base rounded to float16 (saturating), the rest decode to the base.
    deviation = x.reshape(-1).float() - base
    expected = base.clone()
    expected[idx] += deviation[idx].clamp(-F16_MAX, F16_MAX).half().float()
    if x.dtype == torch.float16:
        expected.clamp_(-F16_MAX, F16_MAX)
    assert torch.equal(y, expected.to(x.dtype))
    if spec == "topk:1":
        assert torch.equal(y, x.reshape(-1).double().clamp(-F16_MAX, F16_MAX).to(torch.float16).to(x.dtype))


@pytest.mark.timeout(60)
@FAST
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 50),
    fraction=st.sampled_from([0.01, 0.1, 0.26, 0.5, 1.0]),
    seed=st.integers(0, 2**31),
    zeros=st.booleans(),
)
def test_topk_keeps_its_share_in_every_row(rows: int, cols: int, fraction: float, seed: int, zeros: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    # Rows of very different norms: a budget over the whole tensor would go to the largest rows alone.
    x = torch.randn(rows, cols, generator=g) * 10.0 ** torch.arange(rows).remainder(7).unsqueeze(1)
    if zeros:
        x[::3, ::2] = 0
    codec = get_codec(f"topk:{fraction}")
    assert isinstance(codec, TopKCodec)
    base, idx, _ = codec.parts(codec.encode(x), x.shape)
    budget = codec.max_count(x.numel())
    assert idx.numel() <= budget
    deviation = (x.reshape(-1) - base).abs().view(rows, cols)
    kept = torch.zeros(rows * cols, dtype=torch.bool)
    kept[idx] = True
    share = budget // rows
    for row, sent in zip(deviation, kept.view(rows, cols)):
        assert int(sent.sum()) >= min(share, int((row != 0).sum()))
        # Within a row, what is kept is a top set of that row's deviations from the base.
        if sent.any() and not sent.all():
            assert float(row[sent].min()) >= float(row[~sent].max())


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("spec", "shape", "dims"),
    [
        ("topk:0.1", (8, 64, 128), (512, 128)),
        ("topk:0.1", (64, 64), (64, 64)),
        ("topk:0.1", (5, 13), None),  # the base would cost more than the 7 entries kept
        ("topk:0.01", (8, 64, 128), None),
        ("topk:0.1", (4096,), None),
        ("topk:0.1", (4096, 1), None),
        ("topk:1", (64, 64), None),  # nothing is dropped
    ],
)
def test_topk_base_follows_the_shape(spec: str, shape: tuple[int, ...], dims: tuple[int, int] | None) -> None:
    codec = get_codec(spec)
    assert isinstance(codec, TopKCodec)
    assert codec.base_dims(shape) == dims
    payload = codec.encode(torch.randn(shape))
    base_bytes = 4 * sum(dims) if dims else 0
    assert len(payload) == HEADER.size + base_bytes + 6 * codec.max_count(math.prod(shape))
    if dims:
        assert base_bytes * 4 <= 6 * codec.max_count(math.prod(shape))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("structure", ["channel_offsets", "rank_one"])
def test_topk_base_carries_rank_one_structure(structure: str) -> None:
    g = torch.Generator().manual_seed(3)
    codec = get_codec("topk:0.1")
    # Residual-stream-like per-channel offsets (the same vector in every token), or any rank-1 part, plus noise.
    rows = torch.ones(512, 1) if structure == "channel_offsets" else torch.randn(512, 1, generator=g)
    x = rows * torch.randn(128, generator=g) * 50 + torch.randn(512, 128, generator=g)
    y = _roundtrip(codec, x)
    assert float((y - x).norm() / x.norm()) < 0.03
    # Without a base, with the 12 largest of each row's 128 entries, most of it would be lost.
    plain = x.clone()
    plain[x.abs() < x.abs().kthvalue(128 - 12, dim=1, keepdim=True).values] = 0
    assert float((plain - x).norm() / x.norm()) > 0.5


@pytest.mark.timeout(30)
def test_topk_base_near_float32_limits() -> None:
    codec = get_codec("topk:0.1")
    big = torch.finfo(torch.float32).max
    x = torch.full((64, 64), big)
    x[::2] = -big  # rows of alternating sign: v overflows, the base falls back to zeros
    y = _roundtrip(codec, x)
    assert bool(torch.isfinite(y).all())
    base, _, _ = codec.parts(codec.encode(x), x.shape)
    assert not bool(base.any())
    # float16 output: a base beyond fp16's range saturates instead of turning into Inf.
    x16 = (torch.randn(64, 1) * torch.randn(64) * 3e4).clamp(-6e4, 6e4).half()
    assert bool(torch.isfinite(_roundtrip(codec, x16)).all())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e30])
def test_topk_rejects_bad_bases(value: float) -> None:
    codec, payload = _valid("topk:0.1", (64, 64))
    assert isinstance(codec, TopKCodec) and codec.base_dims((64, 64)) == (64, 64)
    corrupted = bytearray(payload)
    # u_0 and v_0: 1e30 each is finite, but their product is not.
    corrupted[HEADER.size : HEADER.size + 4] = np.float32(value).tobytes()
    corrupted[HEADER.size + 4 * 64 : HEADER.size + 4 * 65] = np.float32(value).tobytes()
    with pytest.raises(CodecError, match="base"):
        codec.decode(bytes(corrupted), (64, 64), torch.float32)
    for cut in (1, 4 * 64, len(payload) - HEADER.size - 1):
        with pytest.raises(CodecError):
            codec.decode(payload[:-cut], (64, 64), torch.float32)
    with pytest.raises(CodecError):
        codec.decode(_header(payload, version=1), (64, 64), torch.float32)


@pytest.mark.timeout(60)
@settings(deadline=None, max_examples=60)
@given(seed=st.integers(0, 2**31), keep=st.integers(0, 4 * 128))
def test_topk_garbage_with_a_base_raises_codec_error_or_decodes(seed: int, keep: int) -> None:
    codec, payload = _valid("topk:0.1", (64, 64))
    noise = np.random.default_rng(seed).integers(0, 256, len(payload) - HEADER.size, dtype=np.uint8).tobytes()
    # A genuine header and the first `keep` bytes of the base, the rest random.
    garbage = payload[: HEADER.size + keep] + noise[keep:]
    try:
        y = codec.decode(garbage, (64, 64), torch.float32)
    except CodecError:
        return
    assert y.shape == (64, 64) and bool(torch.isfinite(y).all())


@pytest.mark.timeout(60)
@FAST
@given(
    magnitude=st.lists(st.floats(0, 1e6, width=32), min_size=1, max_size=300).map(
        lambda v: np.array(v, dtype=np.float32)
    ),
    fraction=st.floats(0.001, 1.0),
)
def test_topk_selection_is_a_top_set(magnitude: np.ndarray, fraction: float) -> None:
    k = max(1, math.ceil(fraction * magnitude.size))
    idx = TopKCodec._select(magnitude, k)
    assert idx.size == k
    assert bool((np.diff(idx) > 0).all())
    dropped = np.delete(magnitude, idx)
    assert dropped.size == 0 or magnitude[idx].min() >= dropped.max()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fraction", [0.1, 0.01, 0.0001])
@pytest.mark.parametrize("data", ["normal", "heavy", "ties"])
def test_topk_sampled_threshold(fraction: float, data: str) -> None:
    g = torch.Generator().manual_seed(7)
    n = 300_000
    x = torch.randn(n, generator=g)
    if data == "heavy":
        x = x / torch.rand(n, generator=g).clamp(min=1e-3) ** 0.7
    elif data == "ties":
        x = torch.round(x * 2)
    magnitude = x.abs().numpy()
    k = math.ceil(fraction * n)
    idx = TopKCodec._select(magnitude, k)
    assert 0 < idx.size <= k
    assert bool((np.diff(idx) > 0).all())
    dropped = np.delete(magnitude, idx)
    assert magnitude[idx].min() >= dropped.max()
    if data != "ties":
        # The estimate aims a little under the budget; it must not waste most of it.
        assert idx.size >= 0.7 * k


@pytest.mark.timeout(60)
@FAST
@given(x=float_tensors(max_scale=1e30), spec=st.sampled_from(["powersgd:rank=1", "powersgd:rank=4"]))
def test_powersgd_never_exceeds_the_input(x: torch.Tensor, spec: str) -> None:
    codec = get_codec(spec)
    y = _roundtrip(codec, x)
    if codec.matrix(tuple(x.shape)) is None:
        assert torch.equal(y, x.float().to(x.dtype))
    else:
        err = (y.double() - x.double()).norm()
        assert err <= x.double().norm() * (1 + 1e-3) + _slack(x.dtype) * math.sqrt(x.numel())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shape", [(64, 48), (10, 3, 7), (200, 5)])
def test_powersgd_is_exact_on_low_rank_input(shape: tuple[int, ...]) -> None:
    codec = get_codec("powersgd:rank=3")
    g = torch.Generator().manual_seed(3)
    rows, cols = shape[0], math.prod(shape[1:])
    x = (torch.randn(rows, 2, generator=g) @ torch.randn(2, cols, generator=g)).view(shape)
    y = _roundtrip(codec, x)
    assert (y - x).norm() <= 1e-4 * x.norm()


# ---------------------------------------------------------------------------------------------------------
# NaN and Inf


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
def test_casts_carry_nan_and_inf(spec: str) -> None:
    x = torch.tensor([1.0, math.nan, math.inf, -math.inf, -2.0, 0.0])
    y = _roundtrip(get_codec(spec), x)
    assert bool(y[1].isnan())
    assert y[2] == math.inf and y[3] == -math.inf
    assert y[0] == 1.0 and y[4] == -2.0 and y[5] == 0.0


@pytest.mark.timeout(30)
def test_fp16_saturates_finite_values_beyond_its_range() -> None:
    x = torch.tensor([1e5, -1e10, 65519.0, 65520.0, 3e38, math.inf, -math.inf], dtype=torch.float32)
    y = _roundtrip(get_codec("fp16"), x)
    assert y[:5].tolist() == [F16_MAX, -F16_MAX, F16_MAX, F16_MAX, F16_MAX]
    assert y[5] == math.inf and y[6] == -math.inf
    big = torch.tensor([1e300, -1e300], dtype=torch.float64)
    assert _roundtrip(get_codec("fp16"), big).tolist() == [F16_MAX, -F16_MAX]


@pytest.mark.timeout(30)
def test_bf16_saturates_near_float32_max() -> None:
    x = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max])
    y = _roundtrip(get_codec("bf16"), x)
    bf16_max = torch.finfo(torch.bfloat16).max
    assert y.tolist() == [bf16_max, -bf16_max]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", LOSSY_CHECKED)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("numel", [1, 100, 70_000])
def test_lossy_codecs_refuse_non_finite_input(spec: str, bad: float, numel: int) -> None:
    codec = get_codec(spec)
    state = codec.new_state()
    x = torch.randn(numel if not spec.startswith("powersgd") else (numel // 10 + 1, 10))
    codec.encode(x, state)
    before = None if state is None or state.residual is None else state.residual.clone()
    x.view(-1)[x.numel() // 2] = bad
    with pytest.raises(CodecError, match="non-finite"):
        codec.encode(x, state)
    if before is not None:
        assert torch.equal(state.residual, before)


@pytest.mark.timeout(30)
def test_float64_beyond_float32_range_is_non_finite() -> None:
    x = torch.tensor([1.0, 1e300], dtype=torch.float64)
    for spec in LOSSY_CHECKED:
        with pytest.raises(CodecError):
            get_codec(spec).encode(x.view(2, 1).expand(2, 8).contiguous())


@pytest.mark.timeout(30)
def test_powersgd_refuses_factors_that_overflow() -> None:
    codec = get_codec("powersgd:rank=2")
    state = codec.new_state()
    with pytest.raises(CodecError, match="overflow"):
        codec.encode(torch.full((64, 512), 3e38), state)
    assert state.residual is None and state.q is None


@pytest.mark.timeout(30)
def test_topk_saturates_values_and_keeps_the_rest_in_the_residual() -> None:
    codec = get_codec("topk:0.5")
    state = codec.new_state()
    x = torch.tensor([1e6, 1.0, -2e5, 0.5])
    y = _roundtrip(codec, x, state)
    assert y.tolist() == [F16_MAX, 0.0, -F16_MAX, 0.0]
    assert torch.allclose(state.residual, x - y)


# ---------------------------------------------------------------------------------------------------------
# Error feedback


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("spec", "shape", "steps", "bound"),
    [
        ("topk:0.1", (64, 128), 300, 3.0),
        ("topk:0.01", (64, 128), 300, 12.0),
        ("topk:0.1", (400, 500), 40, 3.0),
        ("powersgd:rank=2", (64, 48), 300, 8.0),
        ("powersgd:rank=4", (8, 3, 20), 300, 3.0),
    ],
)
@pytest.mark.parametrize("heavy", [False, True])
def test_error_feedback_stays_bounded(spec: str, shape: tuple[int, ...], steps: int, bound: float, heavy: bool) -> None:
    codec = get_codec(spec)
    state = codec.new_state()
    g = torch.Generator().manual_seed(11)
    total = torch.zeros(shape, dtype=torch.float64)
    sent = torch.zeros(shape, dtype=torch.float64)
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(shape, generator=g)
        if heavy:
            x = x / torch.rand(shape, generator=g).clamp(min=1e-2)
        sent += _roundtrip(codec, x, state).double()
        total += x.double()
        worst = max(worst, float(state.residual.norm() / x.norm()))
    assert worst <= bound * (3 if heavy else 1)
    # What was sent plus what is still owed is exactly what came in: nothing is lost for good.
    assert (total - sent - state.residual.double()).norm() <= 1e-5 * total.norm()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", ["topk:0.1", "powersgd:rank=2"])
def test_state_without_error_feedback_sends_each_message_on_its_own(spec: str) -> None:
    codec = get_codec(spec)
    state = codec.new_state(error_feedback=False)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(30, 20, generator=g)
        kept = x.clone()
        alone = codec.decode(codec.encode(x, codec.new_state()), x.shape, x.dtype)
        y = _roundtrip(codec, x, state)
        assert state.residual is None
        assert torch.equal(x, kept)  # the input is not used as scratch space
        if spec.startswith("topk"):
            assert torch.equal(y, alone)
    if spec.startswith("powersgd"):
        assert state.q is not None and state.q.shape == (2, 20)  # the warm start still carries over


@pytest.mark.timeout(30)
def test_error_feedback_resets_on_shape_change() -> None:
    codec = get_codec("topk:0.1")
    state = codec.new_state()
    codec.encode(torch.randn(10, 10), state)
    assert state.residual is not None and state.residual.shape == (10, 10)
    y = _roundtrip(codec, torch.full((5,), 3.0), state)
    assert state.residual.shape == (5,)
    assert int((y != 0).sum()) == 1


@pytest.mark.timeout(30)
def test_powersgd_warm_start_recovers_from_a_zero_gradient() -> None:
    codec = get_codec("powersgd:rank=2")
    state = codec.new_state()
    codec.encode(torch.zeros(30, 20), state)
    assert state.q is None
    x = torch.randn(30, 1) @ torch.randn(1, 20)
    y = _roundtrip(codec, x, state)
    assert (y - x).norm() <= 1e-4 * x.norm()
    assert state.q is not None and state.q.shape == (2, 20)


@pytest.mark.timeout(30)
def test_powersgd_raw_shapes_leave_no_residual() -> None:
    codec = get_codec("powersgd:rank=4")
    state = codec.new_state()
    x = torch.randn(17)
    assert torch.equal(_roundtrip(codec, x, state), x)
    assert state.residual is None


# ---------------------------------------------------------------------------------------------------------
# Hostile payloads


def _valid(spec: str, shape: tuple[int, ...] = (5, 13)) -> tuple[Codec, bytes]:
    codec = get_codec(spec)
    # bytes of its own: none's payload is a view of the tensor, and these tests cut and extend it.
    return codec, bytes(codec.encode(torch.randn(shape, generator=torch.Generator().manual_seed(1))))


def _header(payload: bytes, **fields: int) -> bytes:
    names = ["magic", "version", "codec_id", "flags", "param", "count", "numel"]
    values = dict(zip(names, HEADER.unpack_from(payload)))
    values.update(fields)
    return HEADER.pack(*(values[n] for n in names)) + payload[HEADER.size :]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", SPECS)
def test_truncated_and_extended_payloads(spec: str) -> None:
    codec, payload = _valid(spec)
    for cut in range(len(payload)):
        with pytest.raises(CodecError):
            codec.decode(payload[:cut], (5, 13), torch.float32)
    for extra in (b"\0", b"\0" * 1000):
        with pytest.raises(CodecError):
            codec.decode(payload + extra, (5, 13), torch.float32)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", HEADERED)
def test_payload_shorter_than_its_header(spec: str) -> None:
    codec, payload = _valid(spec)
    with pytest.raises(CodecError):
        codec_from_payload(codec.codec_id, payload[: HEADER.size - 1])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", HEADERED)
def test_wrong_header_fields(spec: str) -> None:
    codec, payload = _valid(spec)
    other = CODEC_IDS["fp16"] if codec.codec_id != CODEC_IDS["fp16"] else CODEC_IDS["bf16"]
    bad = {
        "magic": _header(payload, magic=MAGIC ^ 0xFF),
        "version": _header(payload, version=VERSION + 1),
        "flags": _header(payload, flags=1),
        "codec_id": _header(payload, codec_id=other),
        "param": _header(payload, param=codec.param + 2),
        "numel": _header(payload, numel=64),
        "count": _header(payload, count=HEADER.unpack_from(payload)[5] + 1),
    }
    for field, crafted in bad.items():
        with pytest.raises(CodecError):
            codec.decode(crafted, (5, 13), torch.float32)
        if field in ("magic", "version", "flags", "codec_id"):
            with pytest.raises(CodecError):
                codec_from_payload(codec.codec_id, crafted)
    with pytest.raises(CodecError):
        codec.decode(payload, (5, 14), torch.float32)
    with pytest.raises(CodecError):
        codec.decode(payload, (5, -13), torch.float32)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", HEADERED)
def test_huge_claimed_size_is_refused_before_allocating(spec: str) -> None:
    codec, payload = _valid(spec)
    # 2**40 float32 elements would be 4 TiB: allocating first would fail with another error, or never return.
    huge = _header(payload, numel=2**40)[:1024]
    with pytest.raises(CodecError, match="elements"):
        codec.decode(huge, (5, 13), torch.float32)
    # Even when the receiver expects that many, the payload length (or top-k count) gives the lie away.
    # A top-k payload may legitimately be small for a huge tensor, so only its count can lie.
    huge = _header(payload, numel=2**40, count=2**36 if spec.startswith("topk") else 0)[:1024]
    with pytest.raises(CodecError, match="bytes|budget"):
        codec.decode(huge, (2**20, 2**20), torch.float32)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("spec", "param"),
    [("int8", 0), ("int8", 1), ("int4", 63), ("int8", 2**21), ("topk:0.1", 0), ("topk:0.1", 1_000_001),
     ("powersgd", 0), ("powersgd", 5000), ("fp16", 1)],
)
def test_codec_from_payload_rejects_bad_parameters(spec: str, param: int) -> None:
    codec, payload = _valid(spec)
    with pytest.raises(CodecError):
        codec_from_payload(codec.codec_id, _header(payload, param=param))


@pytest.mark.timeout(30)
def test_codec_from_payload_rejects_unknown_ids_and_non_bytes() -> None:
    codec, payload = _valid("int8")
    for codec_id in (0, 99):
        with pytest.raises(CodecError):
            codec_from_payload(codec_id, _header(payload, codec_id=codec_id))
    with pytest.raises(CodecError):
        codec_from_payload(codec.codec_id, None)  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        codec.decode(12345, (5, 13), torch.float32)  # type: ignore[arg-type]
    assert codec_from_payload(codec.codec_id, bytearray(payload)).name == codec.name
    assert codec.decode(memoryview(payload), (5, 13), torch.float32).shape == (5, 13)


@pytest.mark.timeout(30)
def test_topk_rejects_bad_indices() -> None:
    codec, _ = _valid("topk:0.5")
    n = 10

    def payload(indices: list[int], values: list[float] | None = None) -> bytes:
        k = len(indices)
        vals = np.array(values if values is not None else [1.0] * k, dtype="<f2")
        head = HEADER.pack(MAGIC, VERSION, codec.codec_id, 0, codec.param, k, n)
        return head + np.array(indices, dtype="<i4").tobytes() + vals.tobytes()

    assert codec.decode(payload([1, 4, 9]), (n,), torch.float32).tolist() == [0, 1, 0, 0, 1, 0, 0, 0, 0, 1]
    for indices in ([4, 1], [1, 1], [-1, 3], [3, 10], [0, 2**31 - 1], [0, 1, 2, 3, 4, 5], [2**24, -(2**31)]):
        with pytest.raises(CodecError):
            codec.decode(payload(indices), (n,), torch.float32)
    for value in (math.nan, math.inf):
        with pytest.raises(CodecError, match="non-finite"):
            codec.decode(payload([2], [value]), (n,), torch.float32)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", ["int8", "int4", "powersgd:rank=2"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 0.0])
def test_bad_scales_and_factors(spec: str, value: float) -> None:
    codec, payload = _valid(spec, (30, 20))
    corrupted = bytearray(payload)
    corrupted[HEADER.size : HEADER.size + 4] = np.float32(value).tobytes()
    if spec.startswith("powersgd") and math.isfinite(value):
        assert codec.decode(bytes(corrupted), (30, 20), torch.float32).shape == (30, 20)
    else:
        with pytest.raises(CodecError):
            codec.decode(bytes(corrupted), (30, 20), torch.float32)


@pytest.mark.timeout(60)
@settings(deadline=None, max_examples=150)
@given(garbage=st.binary(max_size=200), spec=st.sampled_from(SPECS), keep_header=st.booleans())
def test_garbage_raises_codec_error_or_decodes_to_the_right_shape(garbage: bytes, spec: str, keep_header: bool) -> None:
    codec, payload = _valid(spec, (3, 4))
    if keep_header:
        # A genuine header with a random body reaches the codec-specific checks.
        garbage = payload[: HEADER.size] + garbage
    try:
        y = codec_from_payload(codec.codec_id, garbage).decode(garbage, (3, 4), torch.float32)
    except CodecError:
        return
    assert y.shape == (3, 4) and y.dtype == torch.float32
