"""The codecs: none, fp16, bf16, int8 and int4 (blockwise absmax), top-k and PowerSGD (error feedback).

Payload bodies, after the header described in base.py, all little-endian:

    none      the tensor's raw bytes in its own dtype (any dtype)
    fp16/bf16 numel values of that format
    int8      ceil(numel / block) float32 scales, then numel int8 values q, x = q * scale
    int4      the same scales, then two 4-bit values per byte (low nibble first) holding q + 8, q in [-7, 7];
              a trailing partial block of odd length is padded with one zero value
    topk      for shapes that get a rank-1 base (TopKCodec.base_dims): rows float32 u, then cols float32 v;
              then count int32 indices, strictly increasing, then count float16 values. The tensor is u v^T
              (zero without a base) plus the values at the indices
    powersgd  P (rows x r) then Qt (r x cols), float32 row-major, x = P @ Qt with rows = shape[0] and
              r = min(rank, rows, cols); tensors with fewer than 2 dims, or too small for P and Q to be
              smaller than the tensor, travel raw as numel float32 values instead

Scales are float32: fp16 scales would overflow above 65504 * qmax and lose precision on small gradients,
for an overhead of 2 bytes per block that is not worth saving. All lossy codecs compute in float32.

Non-finite values:
- none, fp16 and bf16 carry NaN and +-Inf unchanged. Finite values beyond the range of fp16 (+-65504)
  or bf16 saturate to that format's largest finite value instead of turning into Inf.
- int8, int4, topk and powersgd raise CodecError when the input (plus the error-feedback residual) holds
  NaN or Inf, leaving the state unchanged: one NaN would poison a whole block scale or the residual of every
  later step, so the caller must decide (skip the step, send with a lossless codec). float64 inputs beyond
  the float32 range count as Inf. Their decoders reject payloads with non-finite or non-positive scales,
  or non-finite values or factors, which no encoder produces.
- topk values (deviations from the base) beyond +-65504 saturate; with error feedback the clipped part stays
  in the residual. A base that would leave float32's range (or make the deviations do so) is sent as zeros;
  the decoder rejects one whose products could overflow, and saturates float16 outputs.
- powersgd raises CodecError when its float32 factors overflow, which inputs near the float32 range can do.

Decoding checks the payload length against what the header and the receiver's shape allow before it
allocates; a top-k payload is small for any shape, so its decode allocates prod(shape) on the receiver's
word alone, which is the receiver's own expectation.

Error feedback (topk, powersgd): the state keeps the residual, input + residual - decoded, and adds it to
the next input of the same shape. A tensor of another shape than the residual starts afresh (the old
residual is dropped), so one state must serve one stream of like tensors. A state made with
error_feedback=False keeps no residual (each message is compressed on its own) but still carries powersgd's
warm start, which only picks the subspace the next message is projected on and adds nothing of this one to it.

topk keeps its budget per row, the last dimension (for activations, one token's features): each row its
k // rows largest entries, the remainder of the budget the largest of the rest; one-dimensional tensors are
one row. The payload does not depend on it. A matrix whose base costs at most a quarter of the kept entries
(rows x cols with rows + cols <= 6k / 16: an 8x64x128 activation at 10% adds 6.5% to the payload) sends a
rank-1 approximation u v^T of itself densely and keeps the entries that deviate most from it, so that the
dropped ones decode to the base instead of zero. Stage-boundary activations are nearly rank-1 (per-channel
offsets far larger than the rest) and their gradients largely so: bench/convergence.py went from +6.4..6.9% to
+0.3..1.0% validation loss over none with it (see TopKCodec.base_dims), with no error feedback. A per-channel
mean alone reconstructed the activations as well but left the gradients, and the loss, as they were.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from geotrain.compression.base import (
    HEADER,
    Buffer,
    Codec,
    CodecError,
    CodecId,
    FeedbackState,
    Header,
    body,
    cast_into,
    check_shape,
    new_payload,
    new_tensor,
    pack_header,
    peek_body,
    read_body,
    register,
)

try:
    # int8's one-pass C kernel (setup.py builds it where a C compiler is found); the torch path writes the same bytes.
    from geotrain.compression import _blockquant
except ImportError:
    _blockquant = None

_F16_MAX = torch.finfo(torch.float16).max
# Adding 1.5 * 2**23 to a float32 of magnitude below 2**22 rounds it to the nearest integer, which then
# sits in the low mantissa bits, where int4 packs them with integer ops. (int8's torch path rounds with an in-place
# torch.round and casts to int8, with torch 2.13 as fast as the add and the int32-to-int8 cast, or a little faster.)
_ROUND_MAGIC = 1.5 * 2**23
# Floor of a block scale so that 1 / scale stays finite for all-zero and subnormal blocks.
_MIN_SCALE = 2.0**-120
# Elements per pass of (de)quantisation, see _row_chunks: 4 MiB of float32 stays in cache between passes, and
# fewer, larger passes spend less on launching ops (int8 on 8x128x1024 and 4096x4096: 1<<20 beat 1<<18 and 1<<19).
_CHUNK = 1 << 20
# Top-k: tensors up to this size take the exact top-k; larger ones estimate the threshold from a sample.
_TOPK_SAMPLE = 1 << 16
_MAX_INDEXED = 2**31 - 1
_MAX_RANK = 1024
_MAX_BLOCK = 1 << 20
# Top-k's rank-1 base: power iterations (on the gradients crossing the last stage boundary in bench/convergence.py,
# top-k around the base left 0.37 of the squared norm with 3, 0.55 with 1, 0.59 without a base), and a bound on its
# entries that leaves room for the float16 deviations.
_BASE_ITERATIONS = 3
_BASE_LIMIT = torch.finfo(torch.float32).max / 2


def _all_finite(x: torch.Tensor) -> bool:
    # amax and amin propagate NaN and are two fast reductions; isfinite().all() is several times slower.
    return x.numel() == 0 or (math.isfinite(x.amax()) and math.isfinite(x.amin()))


def _row_chunks(rows: int, width: int) -> list[slice]:
    """Consecutive slices of rows, about _CHUNK elements each, the first the largest.

    A pass over a chunk leaves it in cache for the next pass, where whole-tensor passes would each stream it from
    memory; temporaries of chunk size are reused instead of faulting in fresh pages.
    """
    step = max(1, _CHUNK // width)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _rank1(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors u (unit norm) and v of a rank-1 approximation u v^T of the matrix `m`, zeros when `m` is zero or the
    factors would leave the range _base_in_range allows.

    A few power iterations from a fixed start: not the best rank-1 approximation, but a good one after a few,
    and whatever u and v are, the payload carries them and the kept entries are deviations from u v^T.
    """
    rows, cols = m.shape
    v = torch.randn(cols, generator=torch.Generator().manual_seed(cols))
    for _ in range(_BASE_ITERATIONS):
        u = m @ v
        norm = float(torch.linalg.vector_norm(u))
        if not 0 < norm < math.inf:
            return torch.zeros(rows), torch.zeros(cols)
        u /= norm
        # u @ m reads m row by row, like PowerSGD's p.T @ m.
        v = u @ m
    if not _base_in_range(u, v):
        return torch.zeros(rows), torch.zeros(cols)
    return u, v


def _base_in_range(u: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether every product u_i v_j, plus any float16 value, stays finite in float32 (NaN fails too)."""
    if not (_all_finite(u) and _all_finite(v)):
        return False
    return float(u.abs().amax()) * float(v.abs().amax()) <= _BASE_LIMIT


def _feeds_back(state: FeedbackState | None) -> bool:
    return state is not None and state.error_feedback


def _accumulate(flat: torch.Tensor, shape: tuple[int, ...], state: FeedbackState | None) -> torch.Tensor:
    """Input plus residual as float32, a tensor of its own under error feedback; raises on non-finite."""
    x = flat.float()
    if _feeds_back(state):
        residual = state.residual
        x = x + residual.view(-1) if residual is not None and residual.shape == shape else x.clone()
    if not _all_finite(x):
        raise CodecError("cannot encode non-finite values (NaN or Inf in the input or its residual)")
    return x


@register
class NoneCodec(Codec):
    """Raw little-endian bytes of any dtype, without a payload header: the frame's dtype and shape say everything,
    and it is the format the protocol's state transfer uses, so CODEC_NONE means one thing on the wire. A CPU
    tensor's payload is a view of its own memory, not a copy: its caller keeps it unchanged until the payload is
    sent."""

    codec_id = CodecId.NONE
    base_name = "none"
    dtypes = None
    headerless = True

    def encoded_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """The raw bytes."""
        return math.prod(shape) * dtype.itemsize

    def encode(self, tensor: torch.Tensor, state: FeedbackState | None = None) -> Buffer:
        """The tensor's bytes. A tensor numpy views as it is (on the CPU, contiguous, not empty, outside autograd, of
        a dtype numpy has: as a node sends it) is viewed in one call; the general path's five torch ops were a tenth
        of a raw tensor stream's CPU above a raw socket's, each message's copy evicting their code from the cache
        (bench/tensor_path.py)."""
        if state is None:
            try:
                return memoryview(tensor.numpy()).cast("B")
            except (AttributeError, TypeError, RuntimeError):
                pass  # not a tensor, or not one numpy views as it is: the general path checks and copies
        return super().encode(tensor, state)

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], state: FeedbackState | None) -> memoryview:
        return memoryview(flat.contiguous().view(torch.uint8).numpy())

    def _decode(
        self, view: memoryview, header: Header | None, shape: tuple[int, ...], dtype: torch.dtype, pin: bool
    ) -> torch.Tensor:
        out = new_tensor(shape, dtype, pin)
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(view, np.uint8)
        return out


class _CastCodec(Codec):
    """Values cast to a 16-bit float format, saturating finite values beyond its range."""

    wire_dtype: ClassVar[torch.dtype]

    def encoded_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Header plus two bytes per element."""
        return HEADER.size + math.prod(shape) * 2

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], state: FeedbackState | None) -> bytearray:
        n = flat.numel()
        payload, buf = new_payload(self.codec_id, 0, 0, n, 2 * n)
        out = body(buf, 0, n, self.wire_dtype)
        out.copy_(flat)
        # Checking the 2-byte result keeps the common case to one extra half-size pass.
        if bool(torch.isinf(out).any()):
            over = torch.isinf(out) & torch.isfinite(flat)
            # In float32: the largest fp16 is not representable in bf16 (the input may be bf16).
            out[over] = (flat[over].float().sign() * torch.finfo(self.wire_dtype).max).to(self.wire_dtype)
        return payload

    def _decode(
        self, view: memoryview, header: Header, shape: tuple[int, ...], dtype: torch.dtype, pin: bool
    ) -> torch.Tensor:
        return cast_into(read_body(view, 0, header.numel, self.wire_dtype), shape, dtype, pin)


@register
class Fp16Codec(_CastCodec):
    """IEEE half precision."""

    codec_id = CodecId.FP16
    base_name = "fp16"
    wire_dtype = torch.float16


@register
class Bf16Codec(_CastCodec):
    """bfloat16: float32's range with 8 bits of mantissa."""

    codec_id = CodecId.BF16
    base_name = "bf16"
    wire_dtype = torch.bfloat16


class _BlockQuantCodec(Codec):
    """Blockwise absmax quantisation to signed integers in [-qmax, qmax], one float32 scale per block."""

    qmax: ClassVar[int]
    per_byte: ClassVar[int]
    code_offset: ClassVar[int]
    """Added to each code q so that it packs as an unsigned field."""

    param_key = "block"
    param_default = 64
    param_range = (2, _MAX_BLOCK)

    @classmethod
    def check_param(cls, param: int) -> None:
        """The block size must be in range and hold whole bytes."""
        super().check_param(param)
        if param % cls.per_byte:
            raise CodecError(f"{cls.base_name} block size must be a multiple of {cls.per_byte}, got {param}")

    def _packed(self, count: int) -> int:
        return -(-count // self.per_byte)

    def encoded_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Header, one float32 scale per block, packed values."""
        n = math.prod(shape)
        full, tail = divmod(n, self.param)
        return HEADER.size + 4 * -(-n // self.param) + self._packed(full * self.param) + self._packed(tail)

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], state: FeedbackState | None) -> bytearray:
        x = flat.float()
        n, block = x.numel(), self.param
        full, tail = divmod(n, block)
        blocks = full + (tail > 0)
        main_bytes = self._packed(full * block)
        qbytes = main_bytes + self._packed(tail)
        payload, buf = new_payload(self.codec_id, block, 0, n, 4 * blocks + qbytes)
        scales = body(buf, 0, blocks, torch.float32)
        q = body(buf, 4 * blocks, qbytes, torch.uint8)
        if full:
            self._quantize(x[: full * block].view(full, block), scales[:full], q[:main_bytes].view(full, -1))
        if tail:
            # The zero pad gives int4 whole bytes and cannot change the block's absmax.
            rest = F.pad(x[full * block :], (0, self._packed(tail) * self.per_byte - tail))
            self._quantize(rest.view(1, -1), scales[full:], q[main_bytes:].view(1, -1))
        # NaN and Inf propagate into the scale of their block and from there into the largest scale.
        if n and not math.isfinite(scales.amax()):
            raise self._non_finite()
        return payload

    def _non_finite(self) -> CodecError:
        return CodecError(f"{self.name} cannot encode non-finite values (NaN or Inf)")

    def _quantize(self, rows: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """Quantise each row of `rows` as one block into `out`, writing its scale to `scales`."""
        chunks = _row_chunks(rows.shape[0], rows.shape[1])
        tmp = torch.empty(chunks[0].stop, rows.shape[1])
        for chunk in chunks:
            part, scale = rows[chunk], scales[chunk]
            codes = tmp[: part.shape[0]]
            # Floats with the sign bit cleared order as int32 like their magnitudes, NaN above Inf: one elementwise
            # pass and one reduction instead of the two reductions amax and amin.
            bits = torch.bitwise_and(part.view(torch.int32), 0x7FFFFFFF, out=codes.view(torch.int32))
            # Not amax(out=) into the payload's scales and in-place ops there: bench/codecs.py ran the 8x128x1024
            # encode at 5-7 GB/s that way, 8 with this temporary.
            absmax = bits.amax(1).view(torch.float32)
            torch.div(absmax.clamp_(min=self.qmax * _MIN_SCALE), self.qmax, out=scale)
            self._pack(torch.mul(part, scale.reciprocal().unsqueeze(1), out=codes), out[chunk])

    @abc.abstractmethod
    def _pack(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        """Round the scaled float32 values (in [-qmax, qmax], one block per row, scratch space) to the nearest
        integer q, ties to even, and store them into the payload bytes `out`."""

    def _decode(
        self, view: memoryview, header: Header, shape: tuple[int, ...], dtype: torch.dtype, pin: bool
    ) -> torch.Tensor:
        n, block = header.numel, self.param
        if not n:
            return new_tensor(shape, dtype, pin)
        full, tail = divmod(n, block)
        blocks = full + (tail > 0)
        # Read in place: a copy of the scales cost as much as a tenth of the whole decode of an 8x128x1024 tensor.
        scales = peek_body(view, 0, blocks, torch.float32)
        # Comparisons with NaN are false, so NaN scales fail too. numpy: on a few thousand scales its two reductions
        # cost a fraction of torch's.
        if not (scales.numpy().min() > 0 and scales.numpy().max() < math.inf):
            raise CodecError(f"{self.name} payload has non-finite or non-positive block scales")
        out = torch.empty(n, dtype=torch.float32)
        packed = peek_body(view, 4 * blocks, self._packed(full * block) + self._packed(tail), torch.uint8)
        self._dequantize_all(packed, scales, out)
        return cast_into(out, shape, dtype, pin)

    def _dequantize_all(self, packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """Dequantise all packed values with their block scales into the float32 `out`."""
        full, tail = divmod(out.numel(), self.param)
        main_bytes = self._packed(full * self.param)
        if full:
            rows, main = out[: full * self.param].view(full, self.param), packed[:main_bytes].view(full, -1)
            for chunk in _row_chunks(full, self.param):
                self._unpack(main[chunk], rows[chunk], scales[chunk])
        if tail:
            rest = torch.empty(1, self._packed(tail) * self.per_byte)
            self._unpack(packed[main_bytes:].view(1, -1), rest, scales[full:])
            out[full * self.param :] = rest[0, :tail]

    @abc.abstractmethod
    def _unpack(self, packed: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
        """Dequantise packed payload bytes, one block per row, into the float32 rows `out`."""


@register
class Int8Codec(_BlockQuantCodec):
    """int8 blockwise absmax: one byte per value plus a float32 scale per block."""

    codec_id = CodecId.INT8
    base_name = "int8"
    qmax = 127
    per_byte = 1
    code_offset = 0

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], state: FeedbackState | None) -> bytearray:
        if _blockquant is None:
            return super()._encode(flat, shape, state)
        payload = _blockquant.int8_encode(flat.float().numpy(), self.param, HEADER.size, torch.get_num_threads())
        if payload is None:
            raise self._non_finite()
        pack_header(payload, self.codec_id, self.param, 0, flat.numel())
        return payload

    def _dequantize_all(self, packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        if _blockquant is None:
            super()._dequantize_all(packed, scales, out)
        else:
            _blockquant.int8_decode(packed.numpy(), scales.numpy(), self.param, out.numpy(), torch.get_num_threads())

    def _pack(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        # round_ then the float-to-int8 cast: on 8x128x1024 faster than the add of _ROUND_MAGIC and an int32 cast.
        out.view(torch.int8).copy_(scaled.round_())

    def _unpack(self, packed: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
        out.copy_(packed.view(torch.int8)).mul_(scales.unsqueeze(1))


@register
class Int4Codec(_BlockQuantCodec):
    """int4 blockwise absmax: two values per byte plus a float32 scale per block."""

    codec_id = CodecId.INT4
    base_name = "int4"
    qmax = 7
    per_byte = 2
    code_offset = 8

    def _pack(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        # The low byte of the rounded-by-magic bits is q + code_offset.
        codes = scaled.add_(_ROUND_MAGIC + self.code_offset).view(torch.int32)
        torch.bitwise_or(codes[:, 0::2], codes[:, 1::2].bitwise_left_shift(4), out=out)

    def _unpack(self, packed: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
        out[:, 0::2] = packed & 15
        out[:, 1::2] = packed >> 4
        out.sub_(self.code_offset).mul_(scales.unsqueeze(1))


class _FeedbackCodec(Codec):
    """A codec that keeps error feedback per link."""

    def new_state(self, error_feedback: bool = True) -> FeedbackState:
        """Fresh per-link state, keeping the residual or not."""
        return FeedbackState(error_feedback=error_feedback)


@register
class TopKCodec(_FeedbackCodec):
    """Top-k sparsification per row around a rank-1 base, with error feedback; a large selection estimates its
    threshold from a sample."""

    codec_id = CodecId.TOPK
    base_name = "topk"
    param_range = (1, 1_000_000)
    """The kept fraction in parts per million."""

    @classmethod
    def parse_arg(cls, arg: str | None) -> int:
        """Kept fraction in (0, 1], e.g. "0.1"; travels as parts per million."""
        try:
            fraction = float(arg) if arg is not None else math.nan
        except ValueError:
            fraction = math.nan
        if not 0 < fraction <= 1:
            raise CodecError(f"topk needs a kept fraction in (0, 1], e.g. 'topk:0.1', got {arg!r}")
        ppm = round(fraction * 1_000_000)
        if ppm == 0:
            raise CodecError(f"topk fraction {fraction} is below the resolution of 1e-6")
        return ppm

    @property
    def name(self) -> str:
        """Canonical spec string, e.g. "topk:0.1"."""
        return f"topk:{self.param / 1_000_000:g}"

    def max_count(self, numel: int) -> int:
        """Most entries a payload of a `numel`-element tensor may keep: ceil(fraction * numel)."""
        return -(-self.param * numel // 1_000_000)

    def base_dims(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """(rows, cols) of the rank-1 base that payloads for `shape` carry, or None when they carry none.

        A base where it costs at most a quarter of the kept entries' bytes and some entries are dropped: a matrix
        (rows = all but the last dimension) with at least two rows and two columns.
        """
        n = math.prod(shape)
        if len(shape) < 2 or n == 0:
            return None
        cols = shape[-1]
        rows = n // cols
        k = self.max_count(n)
        if rows < 2 or cols < 2 or k >= n or 4 * 4 * (rows + cols) > 6 * k:
            return None
        return rows, cols

    def _base_nbytes(self, shape: tuple[int, ...]) -> int:
        dims = self.base_dims(shape)
        return 0 if dims is None else 4 * sum(dims)

    def encoded_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Header, the rank-1 base if any, plus an int32 index and a float16 value per kept entry, at most."""
        return HEADER.size + self._base_nbytes(shape) + 6 * self.max_count(math.prod(shape))

    def _payload_nbytes(self, header: Header, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        if header.count > self.max_count(header.numel):
            raise CodecError(f"{self.name} payload keeps {header.count} of {header.numel} elements, above its budget")
        return HEADER.size + self._base_nbytes(shape) + 6 * header.count

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], state: FeedbackState | None) -> bytearray:
        n = flat.numel()
        if n > _MAX_INDEXED:
            raise CodecError(f"topk indexes with int32; a tensor of {n} elements is too large")
        acc = _accumulate(flat, shape, state)
        dims = self.base_dims(shape)
        deviation, factors = acc, []
        if dims is not None:
            factors = list(_rank1(acc.view(dims)))
            base = torch.outer(*factors).view(-1)
            deviation = torch.sub(acc, base, out=base)
            if not _all_finite(deviation):
                # The input near float32's limits with a base of the other sign: send the input itself.
                factors, deviation = [f.zero_() for f in factors], acc.clone()
        magnitude = deviation.abs().numpy()
        if len(shape) > 1 and n:
            magnitude = magnitude.reshape(-1, shape[-1])
        idx = torch.from_numpy(self._select_rows(magnitude, self.max_count(n)))
        k = idx.numel()
        offset = self._base_nbytes(shape)
        payload, buf = new_payload(self.codec_id, self.param, k, n, offset + 6 * k)
        start = 0
        for factor in factors:
            body(buf, start, factor.numel(), torch.float32).copy_(factor)
            start += 4 * factor.numel()
        body(buf, offset, k, torch.int32).copy_(idx)
        values = body(buf, offset + 4 * k, k, torch.float16)
        values.copy_(deviation[idx].clamp_(-_F16_MAX, _F16_MAX))
        if _feeds_back(state):
            # Under error feedback acc, and so deviation, is a tensor of its own.
            state.residual = deviation.index_add_(0, idx, values.float(), alpha=-1).view(shape)
        return payload

    @classmethod
    def _select_rows(cls, magnitude: np.ndarray, k: int) -> np.ndarray:
        """Increasing flat indices of at most k non-zero entries of `magnitude`, one row or rows x cols.

        Every row keeps its k // rows largest; the rest of the budget goes to the largest of what is left, wherever
        it is. A row of an activation is one token's features: a budget over the whole tensor would leave the
        tokens of small norm with nothing, and bench/convergence.py trains better per row.
        """
        if magnitude.ndim == 1:
            return cls._select(magnitude, k)
        rows, cols = magnitude.shape
        per_row, extra = divmod(k, rows)
        flat = magnitude.reshape(-1)
        if per_row == 0:
            return cls._select(flat, k)
        if per_row >= cols:
            return np.flatnonzero(flat)
        part = np.argpartition(magnitude, cols - per_row, axis=1)
        part += np.arange(0, rows * cols, cols)[:, None]
        idx = part[:, cols - per_row :].reshape(-1)
        if extra:
            rest = part[:, : cols - per_row].reshape(-1)
            idx = np.concatenate([idx, rest[cls._select(flat[rest], extra)]])
        idx.sort()
        # Never send zeros: a row may have fewer non-zero entries than its share.
        return idx[flat[idx] > 0]

    @staticmethod
    def _select(magnitude: np.ndarray, k: int) -> np.ndarray:
        """Increasing int64 indices of at most k entries, about the k largest of `magnitude`."""
        # numpy: its selection and flatnonzero are several times faster than torch's kthvalue and nonzero.
        n = magnitude.size
        if k == n:
            return np.arange(n)
        if n <= _TOPK_SAMPLE:
            return np.sort(np.argpartition(magnitude, n - k)[n - k :])
        size = _TOPK_SAMPLE
        sample = magnitude[np.random.default_rng(n).integers(0, n, size)]
        expected = size * k / n
        # Many samples above the budget's threshold: aim two standard deviations under k, so that no exact
        # pass is needed and flatnonzero's order is final. Few: aim well over k, then pick the exact top k
        # among the candidates, which are few.
        margin = 2 * math.sqrt(expected) if expected >= 256 else -3 * math.sqrt(expected) - 8
        above = min(size, max(1, int(expected - margin)))
        threshold = np.partition(sample, size - above)[size - above]
        # Never send zeros; the smallest positive float32 turns >= into > 0 when the threshold is 0.
        idx = np.flatnonzero(magnitude >= max(threshold, np.float32(2.0**-149)))
        if idx.size > k:
            idx = np.sort(idx[np.argpartition(magnitude[idx], idx.size - k)[idx.size - k :]])
        return idx

    def parts(self, payload: Buffer, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A validated payload's dense float32 base (zeros without one), its kept flat indices (int64) and the float32
        deviations from the base sent there: the payload decodes to base, plus the deviations at the indices."""
        shape = check_shape(shape)
        view, header = self._checked(payload, shape, torch.float32)
        return self._parts(view, header, shape)

    def _parts(self, view: memoryview, header: Header, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        k, n = header.count, header.numel
        dims = self.base_dims(shape)
        offset = self._base_nbytes(shape)
        # In int64: differences of int32 indices wrap around (2**24 then -2**31 would pass as increasing).
        idx = np.frombuffer(view, "<i4", k, HEADER.size + offset).astype(np.int64)
        if k and (idx[0] < 0 or idx[-1] >= n or not bool((np.diff(idx) > 0).all())):
            raise CodecError(f"{self.name} payload indices must be strictly increasing and within [0, {n})")
        values = read_body(view, offset + 4 * k, k, torch.float16).float()
        if not _all_finite(values):
            raise CodecError(f"{self.name} payload has non-finite values")
        if dims is None:
            return torch.zeros(n), torch.from_numpy(idx), values
        rows, cols = dims
        u, v = read_body(view, 0, rows, torch.float32), read_body(view, 4 * rows, cols, torch.float32)
        if not _base_in_range(u, v):
            raise CodecError(f"{self.name} payload has a non-finite or out-of-range base")
        return torch.outer(u, v).view(-1), torch.from_numpy(idx), values

    def _decode(
        self, view: memoryview, header: Header, shape: tuple[int, ...], dtype: torch.dtype, pin: bool
    ) -> torch.Tensor:
        out, idx, values = self._parts(view, header, shape)
        # index_add_: a fifth faster than out[idx] += values (gather, add, scatter); the indices are distinct.
        out.index_add_(0, idx, values)
        if dtype == torch.float16:
            # A base may overshoot fp16's range where the input did not; saturate as the fp16 codec does.
            out.clamp_(-_F16_MAX, _F16_MAX)
        return cast_into(out, shape, dtype, pin)


@register
class PowerSgdCodec(_FeedbackCodec):
    """PowerSGD rank-r approximation with error feedback and a warm-started right factor."""

    codec_id = CodecId.POWERSGD
    base_name = "powersgd"
    param_key = "rank"
    param_default = 4
    param_range = (1, _MAX_RANK)

    def matrix(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(rows, cols, rank) of the low-rank form of a tensor, or None when it travels raw."""
        if len(shape) < 2:
            return None
        rows = shape[0]
        cols = math.prod(shape[1:])
        rank = min(self.param, rows, cols)
        if rank * (rows + cols) >= rows * cols:
            return None
        return rows, cols, rank

    def encoded_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Header plus float32 factors, or float32 raw values for tensors that travel raw."""
        form = self.matrix(shape)
        if form is None:
            return HEADER.size + 4 * math.prod(shape)
        rows, cols, rank = form
        return HEADER.size + 4 * rank * (rows + cols)

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], state: FeedbackState | None) -> bytearray:
        acc = _accumulate(flat, shape, state)
        form = self.matrix(shape)
        if form is None:
            payload, buf = new_payload(self.codec_id, self.param, 0, acc.numel(), 4 * acc.numel())
            body(buf, 0, acc.numel(), torch.float32).copy_(acc)
            if state is not None:
                state.residual = None
            return payload
        rows, cols, rank = form
        m = acc.view(rows, cols)
        qt = state.q if state is not None and state.q is not None and state.q.shape == (rank, cols) else None
        if qt is None:
            qt = torch.randn(rank, cols, generator=torch.Generator().manual_seed(rows * cols))
        p = m @ qt.T
        if not _all_finite(p):
            raise CodecError(f"{self.name} factors overflow float32; the input is too close to its range")
        # Orthonormal P makes P @ Qt the projection of m onto span(P): the error never exceeds m.
        p = torch.linalg.qr(p).Q
        # p.T @ m reads m row by row; m.T @ p is over twenty times slower on CPU BLAS.
        qt = p.T @ m
        if not _all_finite(qt):
            raise CodecError(f"{self.name} factors overflow float32; the input is too close to its range")
        payload, buf = new_payload(self.codec_id, self.param, 0, acc.numel(), 4 * rank * (rows + cols))
        body(buf, 0, rows * rank, torch.float32).view(rows, rank).copy_(p)
        body(buf, 4 * rows * rank, rank * cols, torch.float32).view(rank, cols).copy_(qt)
        if _feeds_back(state):
            state.residual = m.addmm_(p, qt, alpha=-1).view(shape)
        if state is not None:
            # A zero row (m had lower rank) would stay zero forever; re-seed at the next step instead.
            state.q = qt if bool((qt.abs().amax(1) > 0).all()) else None
        return payload

    def _decode(
        self, view: memoryview, header: Header, shape: tuple[int, ...], dtype: torch.dtype, pin: bool
    ) -> torch.Tensor:
        form = self.matrix(shape)
        if form is None:
            out = values = read_body(view, 0, header.numel, torch.float32)
        else:
            rows, cols, rank = form
            values = read_body(view, 0, rank * (rows + cols), torch.float32)
            out = values[: rows * rank].view(rows, rank) @ values[rows * rank :].view(rank, cols)
        if not _all_finite(values):
            raise CodecError(f"{self.name} payload has non-finite values")
        return cast_into(out, shape, dtype, pin)
