"""An accelerator stand-in for machines without one: tensors on torch's "meta" device, each with a host twin that
holds its value, and a record of the device and dtype of every op that ran.

Every op on meta tensors also runs on their twins, so values come out as the CPU computes them; an op that mixes
meta tensors with host tensors (other than 0-dim ones, which CUDA takes too) raises as on a GPU, and the record
shows what ran on the "device" in which dtype (MPS has no float64). Copies between host and meta move twins.
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


class FakeDevice(TorchDispatchMode):
    """Runs code over meta tensors whose values live in host twins; `ops` records every op."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self._twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor) -> (it, its host value)

    def put(self, host: torch.Tensor) -> torch.Tensor:
        """A meta tensor holding `host`'s values (call outside the mode)."""
        meta = torch.empty_like(host, device="meta")
        self._twins[id(meta)] = (meta, host.clone())
        return meta

    def value(self, meta: torch.Tensor) -> torch.Tensor:
        """The host value of a meta tensor."""
        return self._twins[id(meta)][1]

    def device_ops(self, dtype: torch.dtype) -> list[str]:
        """The names of the ops that read or made a meta tensor of `dtype`."""
        return [op.name for op in self.ops if ("meta", dtype) in op.tensors]

    def _host(self, x):
        if isinstance(x, torch.Tensor) and x.is_meta:
            if id(x) not in self._twins:
                raise RuntimeError("a meta tensor without a host value")
            return self._twins[id(x)][1]
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if func not in _COPIES and any(t.is_meta for t in inputs) and any(not t.is_meta and t.dim() for t in inputs):
            raise RuntimeError(f"{func}: Expected all tensors to be on the same device, but found meta and cpu")
        target = kwargs.get("device")
        if not any(t.is_meta for t in inputs) and (target is None or torch.device(target).type != "meta"):
            out = func(*args, **kwargs)  # a host op: run once (a generator it draws from must advance once)
            self.ops.append(Op(str(func), tuple((t.device.type, t.dtype) for t in (*inputs, *_tensors(out)))))
            return out
        host_kwargs = dict(tree_map(self._host, kwargs))
        if host_kwargs.get("device") == "meta":
            host_kwargs["device"] = torch.device("cpu")
        host_out = func(*tree_map(self._host, args), **host_kwargs)
        if func is torch.ops.aten._to_copy.default and target is not None and torch.device(target).type == "cpu":
            out = host_out  # the host copy of a device tensor is its value
        else:
            out = func(*args, **kwargs)
            for meta, host in zip(tree_leaves(out), tree_leaves(host_out)):
                if isinstance(meta, torch.Tensor) and meta.is_meta:
                    self._twins[id(meta)] = (meta, host)
        self.ops.append(Op(str(func), tuple((t.device.type, t.dtype) for t in (*inputs, *_tensors(out)))))
        return out


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
