"""Codec base class, registry, spec parsing and the fixed payload header.

Every payload but none's (raw bytes, see NoneCodec) starts with a 24-byte little-endian header (struct format ``<BBBBIQQ``):

    magic    u8   0x67 ("g")
    version  u8   2 (version 1 had top-k bodies without their rank-1 base)
    codec id u8   the codec's wire id (same numbers as the geotrain.v1.Codec proto enum)
    flags    u8   0; anything else is rejected
    param    u32  the codec's one parameter: block size (int8/int4), kept fraction in parts per
                  million (topk), rank (powersgd); 0 for the others
    count    u64  per-payload count: number of kept entries (topk); 0 for the others
    numel    u64  element count of the tensor, must equal prod(shape) on the receiving side

24 bytes keep the body 8-byte aligned so it can be viewed as any dtype. The receiver needs only
(codec id, payload, shape, dtype): the header alone rebuilds the codec (codec_from_payload) and the
shape alone fixes the exact payload length, which decode checks before allocating anything.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
import struct
import sys
import warnings
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import numpy as np
import torch

if sys.byteorder != "little":
    # Bodies are written as the host's tensor bytes; the wire format is little-endian.
    raise ImportError("geotrain.compression needs a little-endian host")

MAGIC = 0x67
VERSION = 2
HEADER = struct.Struct("<BBBBIQQ")

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})

Buffer = bytes | bytearray | memoryview


class CodecError(ValueError):
    """A codec spec, tensor or payload that a codec cannot handle."""


class CodecId:
    """Stable wire ids; 0 is UNSPECIFIED, as in the proto enum."""

    UNSPECIFIED = 0
    NONE = 1
    FP16 = 2
    BF16 = 3
    INT8 = 4
    INT4 = 5
    TOPK = 6
    POWERSGD = 7


CODEC_IDS: dict[str, int] = {
    "none": CodecId.NONE,
    "fp16": CodecId.FP16,
    "bf16": CodecId.BF16,
    "int8": CodecId.INT8,
    "int4": CodecId.INT4,
    "topk": CodecId.TOPK,
    "powersgd": CodecId.POWERSGD,
}


class Header(NamedTuple):
    """The decoded fixed header of a payload."""

    codec_id: int
    param: int
    count: int
    numel: int


@dataclasses.dataclass
class FeedbackState:
    """Per-link state of a stateful codec; one per (link, direction), used by one thread at a time."""

    error_feedback: bool = True
    """Keep the residual and add it to the next input. Right for a stream whose messages are summed (a parameter's
    gradients: what one step did not send, a later one does); a bias for a stream of different samples' tensors
    (activations and their gradients), where a residual lands on another sample."""
    residual: torch.Tensor | None = None
    """What earlier encodes did not send, float32 and shaped like the tensor; added to the next input."""
    q: torch.Tensor | None = None
    """PowerSGD's right factor (rank x cols) from the previous encode, the warm start of the next one."""


def read_header(payload: Buffer) -> tuple[memoryview, Header]:
    """Check magic, version and flags and return the payload as bytes plus its header."""
    try:
        view = memoryview(payload).cast("B")
    except TypeError as exc:
        raise CodecError(f"payload must be bytes-like, got {type(payload).__name__}") from exc
    if view.nbytes < HEADER.size:
        raise CodecError(f"payload of {view.nbytes} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, codec_id, flags, param, count, numel = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"bad payload magic 0x{magic:02x}, expected 0x{MAGIC:02x}")
    if version != VERSION:
        raise CodecError(f"unsupported payload version {version}, this build reads version {VERSION}")
    if flags != 0:
        raise CodecError(f"payload flags 0x{flags:02x} are not defined in version {VERSION}")
    return view, Header(codec_id, param, count, numel)


def new_payload(codec_id: int, param: int, count: int, numel: int, body_nbytes: int) -> tuple[bytearray, torch.Tensor]:
    """Allocate a whole payload with its header written, and a uint8 tensor over it through which to fill the body.

    The encoder returns the bytearray itself: writing through the tensor spares a copy of the payload at the end.
    """
    payload = bytearray(HEADER.size + body_nbytes)
    pack_header(payload, codec_id, param, count, numel)
    return payload, torch.frombuffer(payload, dtype=torch.uint8)


def pack_header(payload: bytearray, codec_id: int, param: int, count: int, numel: int) -> None:
    """Write the fixed header into the first HEADER.size bytes of `payload`."""
    HEADER.pack_into(payload, 0, MAGIC, VERSION, codec_id, 0, param, count, numel)


def body(buf: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """View `count` elements of `dtype` at byte `offset` past the header of a payload being built."""
    start = HEADER.size + offset
    return buf[start : start + count * dtype.itemsize].view(dtype)


# torch warns (once per process) that a tensor over read-only bytes could write to them; peek_body's never does.
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning, __name__)


def peek_body(view: memoryview, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over `count` (> 0) elements of `dtype` at byte `offset` past the header, sharing the payload's
    memory instead of copying it: only to be read, and not kept past the payload."""
    return torch.frombuffer(view, dtype=dtype, count=count, offset=HEADER.size + offset)


def read_body(view: memoryview, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Copy `count` elements of `dtype` at byte `offset` past the header into a new writable tensor."""
    out = torch.empty(count, dtype=dtype)
    nbytes = count * dtype.itemsize
    # Via numpy because torch.frombuffer on read-only bytes warns; one memcpy of the compressed data.
    out.view(torch.uint8).numpy()[:] = np.frombuffer(view, np.uint8, nbytes, HEADER.size + offset)
    return out


def new_tensor(shape: Sequence[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised CPU tensor a decoder fills, in pinned memory if `pin` (needs a CUDA build and device)."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin)


def cast_into(values: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A decoder's `values` as the tensor of `shape` and `dtype` it returns: cast in the one pass that writes pinned
    memory when `pin`, else as Tensor.to (no copy where the dtype is already right)."""
    if not pin:
        return values.to(dtype).view(tuple(shape))
    out = new_tensor(shape, dtype, pin)
    out.copy_(values.view(tuple(shape)))
    return out


def check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Return `shape` as a tuple of non-negative ints or raise CodecError."""
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError) as exc:
        raise CodecError(f"shape must be a sequence of ints, got {shape!r}") from exc
    if any(d < 0 for d in dims):
        raise CodecError(f"shape {dims} has a negative dimension")
    return dims


class Codec(abc.ABC):
    """A tensor codec: immutable, shareable between threads; per-link state lives in FeedbackState."""

    codec_id: ClassVar[int]
    base_name: ClassVar[str]
    dtypes: ClassVar[frozenset[torch.dtype] | None] = FLOAT_DTYPES
    """Dtypes the codec accepts; None means any."""

    param_key: ClassVar[str | None] = None
    """Name of the codec's int parameter in specs ("int8:block=128"); None for codecs without one."""
    param_default: ClassVar[int] = 0
    param_range: ClassVar[tuple[int, int]] = (0, 0)
    """Inclusive bounds of the parameter, checked for specs and for payload headers alike."""
    headerless: ClassVar[bool] = False
    """No payload header (none): decode checks the length alone, the frame carries dtype and shape."""

    def __init__(self, param: int = 0) -> None:
        self.check_param(param)
        self.param = param

    @classmethod
    def parse_arg(cls, arg: str | None) -> int:
        """Turn the part of a spec after ':' ("block=128") into the header param."""
        if arg is None:
            return cls.param_default
        key, sep, value = arg.partition("=")
        if cls.param_key is None or not sep or key.strip() != cls.param_key:
            expected = f"'{cls.param_key}=<int>'" if cls.param_key else "no parameters"
            raise CodecError(f"codec {cls.base_name!r} takes {expected}, got {arg!r}")
        try:
            return int(value)
        except ValueError as exc:
            raise CodecError(f"codec {cls.base_name!r}: {key} must be an int, got {value!r}") from exc

    @classmethod
    def check_param(cls, param: int) -> None:
        """Raise CodecError if `param` is not a valid parameter of this codec."""
        low, high = cls.param_range
        if not low <= param <= high:
            what = cls.param_key or "parameter"
            raise CodecError(f"codec {cls.base_name!r}: {what} must be in [{low}, {high}], got {param}")

    @functools.cached_property
    def name(self) -> str:
        """Canonical spec string: get_codec(codec.name) makes an equal codec (read for every tensor sent)."""
        return self.base_name if self.param_key is None else f"{self.base_name}:{self.param_key}={self.param}"

    def __repr__(self) -> str:
        return f"<codec {self.name}>"

    def new_state(self, error_feedback: bool = True) -> FeedbackState | None:
        """Fresh per-link state (see FeedbackState.error_feedback), or None for stateless codecs."""
        return None

    @abc.abstractmethod
    def encoded_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Payload length for a tensor of this shape, header included; an upper bound for top-k."""

    def encode(self, tensor: torch.Tensor, state: FeedbackState | None = None) -> Buffer:
        """Encode `tensor` (on any device) into a payload (a view of the tensor itself for none); updates `state` in
        place."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if state is not None and not isinstance(state, FeedbackState):
            raise TypeError(f"state must come from new_state(), got {type(state).__name__}")
        self._check_dtype(tensor.dtype)
        flat = tensor.detach().to("cpu").reshape(-1)
        return self._encode(flat, tuple(tensor.shape), state)

    def decode(self, payload: Buffer, shape: Sequence[int], dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
        """Decode a payload into a new CPU tensor of exactly `shape` and `dtype`, validating it first; `pin`: in
        pinned (page-locked) memory, which a CUDA device copies from without another copy to pin it."""
        shape = check_shape(shape)
        self._check_dtype(dtype)
        if self.headerless:
            view = memoryview(payload).cast("B")
            expected = self.encoded_nbytes(shape, dtype)
            if view.nbytes != expected:
                raise CodecError(f"{self.name} payload for shape {shape} must be {expected} bytes, got {view.nbytes}")
            return self._decode(view, None, shape, dtype, pin)
        return self._decode(*self._checked(payload, shape, dtype), shape, dtype, pin)

    def _checked(self, payload: Buffer, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[memoryview, Header]:
        """The payload's bytes and header, once header and length agree with this codec, `shape` and `dtype`."""
        view, header = read_header(payload)
        if header.codec_id != self.codec_id:
            raise CodecError(f"payload is for codec id {header.codec_id}, this is {self.name} ({self.codec_id})")
        if header.param != self.param:
            raise CodecError(f"payload parameter {header.param} does not match {self.name}")
        numel = math.prod(shape)
        if header.numel != numel:
            raise CodecError(f"payload holds {header.numel} elements, shape {shape} has {numel}")
        expected = self._payload_nbytes(header, shape, dtype)
        if view.nbytes != expected:
            raise CodecError(f"{self.name} payload for shape {shape} must be {expected} bytes, got {view.nbytes}")
        return view, header

    def _check_dtype(self, dtype: torch.dtype) -> None:
        if not isinstance(dtype, torch.dtype):
            raise CodecError(f"dtype must be a torch.dtype, got {dtype!r}")
        if self.dtypes is not None and dtype not in self.dtypes:
            raise CodecError(f"codec {self.name} does not handle dtype {dtype}")

    def _payload_nbytes(self, header: Header, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Exact length a payload with this header must have; subclasses also bound header.count here."""
        if header.count != 0:
            raise CodecError(f"payload count {header.count} must be 0 for {self.name}")
        return self.encoded_nbytes(shape, dtype)

    @abc.abstractmethod
    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], state: FeedbackState | None) -> Buffer:
        """Encode a flat contiguous CPU tensor that has `shape`."""

    @abc.abstractmethod
    def _decode(
        self, view: memoryview, header: Header, shape: tuple[int, ...], dtype: torch.dtype, pin: bool
    ) -> torch.Tensor:
        """Decode a payload whose header and length are already validated (into pinned memory if `pin`)."""


_REGISTRY: dict[int, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator adding a codec to the registry under its base name and wire id."""
    expected = CODEC_IDS.get(cls.base_name)
    if expected != cls.codec_id:
        raise ValueError(f"codec {cls.base_name!r} has id {cls.codec_id}, CODEC_IDS says {expected}")
    _REGISTRY[cls.codec_id] = cls
    return cls


@functools.lru_cache(maxsize=256)
def _instance(codec_id: int, param: int) -> Codec:
    return _REGISTRY[codec_id](param)


def get_codec(spec: str) -> Codec:
    """Codec for a spec string such as "int8", "int8:block=128", "topk:0.1" or "powersgd:rank=4"."""
    if not isinstance(spec, str):
        raise CodecError(f"codec spec must be a string, got {type(spec).__name__}")
    base, sep, arg = spec.strip().partition(":")
    codec_id = CODEC_IDS.get(base)
    if codec_id is None:
        raise CodecError(f"unknown codec {base!r} in spec {spec!r}; known: {', '.join(CODEC_IDS)}")
    return _instance(codec_id, _REGISTRY[codec_id].parse_arg(arg if sep else None))


def codec_from_payload(codec_id: int, payload: Buffer) -> Codec:
    """Codec that decodes `payload`, rebuilt from the wire id and the payload's own header (if it has one)."""
    cls = _REGISTRY.get(codec_id)
    if cls is not None and cls.headerless:
        return _instance(codec_id, 0)
    _, header = read_header(payload)
    if header.codec_id != codec_id:
        raise CodecError(f"payload header says codec id {header.codec_id}, the message says {codec_id}")
    cls = _REGISTRY.get(codec_id)
    if cls is None:
        raise CodecError(f"unknown codec id {codec_id}")
    cls.check_param(header.param)
    return _instance(codec_id, header.param)
