"""An accelerator stand-in for machines without one: tensors on torch's "meta" device, each meta storage with a
host twin that holds its bytes, and a record of the device and dtype of every op that ran.

Every op on meta tensors also runs on their twins (a meta tensor's twin is its storage's, viewed with its offset,
sizes and strides, so views, detached tensors and Parameters share it as on a GPU), so values come out as the CPU
computes them; an op that mixes meta tensors with host tensors (other than 0-dim ones, which CUDA takes too) raises
as on a GPU, and the record shows what ran on the "device" in which dtype (MPS has no float64). A copy to the host
gives the twin's value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


@dataclass(frozen=True)
class Op:
    """One op that ran: its name and the (device type, dtype) of every tensor it read or made."""

    name: str
    tensors: tuple[tuple[str, torch.dtype], ...]


def _tensors(tree) -> list[torch.Tensor]:  # noqa: ANN001
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class FakeDevice(TorchDispatchMode):
    """Runs code over meta tensors whose bytes live in host twins; `ops` records every op."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self._storages: dict[int, torch.Tensor] = {}  # meta storage -> its host twin's bytes (a flat tensor)
        self._alive: list[torch.Tensor] = []  # a tensor of each storage: no freed storage's address is reused

    def put(self, host: torch.Tensor) -> torch.Tensor:
        """A meta tensor holding `host`'s values (call outside the mode)."""
        meta = torch.empty_like(host, device="meta")
        self._bind(meta, host)
        return meta

    def value(self, meta: torch.Tensor) -> torch.Tensor:
        """The host value of a meta tensor, a copy."""
        return self._host(meta).clone()

    def device_ops(self, dtype: torch.dtype) -> list[str]:
        """The names of the ops that read or made a meta tensor of `dtype`."""
        return [op.name for op in self.ops if ("meta", dtype) in op.tensors]

    def _bind(self, meta: torch.Tensor, host: torch.Tensor) -> None:
        """Make `host`'s value that of `meta` (whose storage is new: an in-place op or a view shares the twin)."""
        key = meta.untyped_storage()._cdata
        if key not in self._storages:
            self._storages[key] = torch.zeros(meta.untyped_storage().nbytes(), dtype=torch.uint8)
            self._alive.append(meta)
            self._host(meta).copy_(host)

    def _host(self, x):  # noqa: ANN001, ANN202
        if isinstance(x, torch.Tensor) and x.is_meta:
            key = x.untyped_storage()._cdata
            if key not in self._storages:
                raise RuntimeError("a meta tensor without a host value")
            extent = x.storage_offset() + sum((n - 1) * st for n, st in zip(x.size(), x.stride()) if n) + 1
            needed = max(extent * x.element_size() if x.numel() else 0, x.untyped_storage().nbytes())
            twin = self._storages[key]
            if twin.numel() < needed:  # a storage resized (an op's out tensor): grow the twin with it
                twin = self._storages[key] = torch.cat([twin, twin.new_zeros(needed - twin.numel())])
            return twin.view(x.dtype).as_strided(x.size(), x.stride(), x.storage_offset())
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if func not in _COPIES and any(t.is_meta for t in inputs) and any(not t.is_meta and t.dim() for t in inputs):
            raise RuntimeError(f"{func}: Expected all tensors to be on the same device, but found meta and cpu")
        target = kwargs.get("device")
        if not any(t.is_meta for t in inputs) and (target is None or torch.device(target).type != "meta"):
            out = func(*args, **kwargs)  # a host op: run once (a generator it draws from must advance once)
        else:
            host_kwargs = dict(tree_map(self._host, kwargs))
            host_out = func(*tree_map(self._host, args), **host_kwargs)
            if func is torch.ops.aten._local_scalar_dense.default or (
                func is torch.ops.aten._to_copy.default and target is not None and torch.device(target).type == "cpu"
            ):
                out = host_out  # the host copy of a device tensor (or its one value, .item()) is its value
            else:
                out = func(*args, **kwargs)
                for meta, host in zip(tree_leaves(out), tree_leaves(host_out)):
                    if isinstance(meta, torch.Tensor) and meta.is_meta:
                        self._bind(meta, host)
        self.ops.append(Op(str(func), tuple((t.device.type, t.dtype) for t in (*inputs, *_tensors(out)))))
        return out
