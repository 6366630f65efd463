"""Gradients: the flat payload layout of one fit, the stale cache's entries, and moving gradients in and out of it.

A rank's payload is one flat tensor: every parameter's gradient in the parameters' order (each in its parameter's
memory order, so a ``channels_last`` weight is read without a permute), then the loss, then the buffers
(BatchNorm statistics, averaged like the gradient so that the replicas stay identical).

A partition's cache entry is what backward left in ``param.grad``, kept as it is (:meth:`Gradients.adopt`): the
tensors autograd allocated, one per parameter, and the loss. Backward writes the fresh gradient where it is cached
and encoded, so no pass copies it. (Pointing ``param.grad`` at a preallocated flat slot instead, as DDP's
``gradient_as_bucket_view`` does, makes autograd add the new gradient into it: the slot must be zeroed first, and
zeroing plus adding reads and writes more bytes than the copy it saves; see docs/results/step_time_passes.md.)
:meth:`Gradients.encode` writes a code straight from the entries, one fused kernel per parameter;
:meth:`Gradients.apply` points ``param.grad`` at the aggregate.

No Lightning and no ``torch.distributed``: the strategy builds one per fit from its module's parameters.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Union

import torch
from torch import Tensor

from lightning_pgc.codes.schemes import _linear_combination
from lightning_pgc.runtime.aggregates import payload_dtype_for

__all__ = ["CONVERT_CHUNK", "Gradients", "PartitionGradient", "flat_like", "grad_view"]

#: elements converted at a time when a code's dtype differs from the gradients' (no payload-sized temporary)
CONVERT_CHUNK = 1 << 20


class PartitionGradient:
    """One partition's gradient: ``tensors[i]`` is parameter ``i``'s gradient (``None``: none, i.e. zeros) as
    backward produced it, and ``loss`` the partition's loss. The stale cache keeps these tensors themselves."""

    __slots__ = ("tensors", "loss")

    def __init__(self, tensors: list[Optional[Tensor]], loss: float) -> None:
        self.tensors = tensors
        self.loss = float(loss)

    @property
    def nbytes(self) -> int:
        """Bytes of the gradient tensors held."""
        return sum(t.numel() * t.element_size() for t in self.tensors if t is not None)


Entry = Union[PartitionGradient, Tensor]  # a cache entry: as backward left it, or flat (gradient, then the loss)


class Gradients:
    """The parameters and buffers of one fit, laid out as one flat payload, and the partitions evaluated this step.

    Args:
        params: every parameter of the module, frozen ones included (finetuning callbacks flip ``requires_grad``
            mid-fit: a layout fixed at the start keeps the payload and the stale cache valid on every rank; a frozen
            parameter sends zeros and gets no gradient).
        buffers: the buffers that travel with the payload (non-empty ones).
        device: where codes and aggregates live (the model's device).
    """

    def __init__(self, params: list[torch.nn.Parameter], buffers: list[Tensor], device: torch.device) -> None:
        self.params = list(params)
        self.buffers = list(buffers)
        self.device = device
        #: elements of the gradient part; the loss is at this index, the buffers after it
        self.grad_numel = sum(p.numel() for p in self.params)
        #: elements of the whole payload: gradient, loss, buffers
        self.numel = self.grad_numel + 1 + sum(b.numel() for b in self.buffers)
        #: the payload's dtype (the parameters', at least float32)
        self.dtype = payload_dtype_for(self.params[0].dtype if self.params else torch.float32)
        self.fresh: dict[int, PartitionGradient] = {}  # partitions evaluated since :meth:`begin_step`
        self._offsets: list[tuple[int, int]] = []
        offset = 0
        for p in self.params:
            self._offsets.append((offset, p.numel()))
            offset += p.numel()

    @classmethod
    def of(cls, module: torch.nn.Module, device: torch.device) -> Gradients:
        """The layout of ``module``: all its parameters, and its non-empty buffers."""
        return cls(list(module.parameters()), [b for b in module.buffers() if b.numel() > 0], device)

    @property
    def nbytes(self) -> int:
        """Bytes of one payload."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def begin_step(self) -> None:
        """A new step: nothing evaluated yet, and no ``param.grad`` (it views the previous aggregate or is a cache
        entry: backward must allocate a new one, never add into it)."""
        self.fresh = {}
        self.zero_grad()

    def adopt(self, partition: int, loss: Optional[Tensor]) -> PartitionGradient:
        """``param.grad`` and the loss as the gradient of ``partition``: the tensors themselves, no copy (the caller
        drops ``param.grad`` before the next backward, :meth:`zero_grad` or :meth:`apply`, so nothing adds into
        them)."""
        tensors = [p.grad.detach() if p.grad is not None else None for p in self.params]
        entry = PartitionGradient(tensors, 0.0 if loss is None else float(loss.detach()))
        self.fresh[partition] = entry
        return entry

    def entry_of(self, flat: Tensor) -> PartitionGradient:
        """A flat gradient (then the loss), e.g. from a checkpoint, as a cache entry: views of ``flat`` on the
        model's device in each parameter's layout."""
        flat = flat.to(self.device)
        tensors: list[Optional[Tensor]] = [
            grad_view(flat[o : o + n], p).to(p.dtype) for (o, n), p in zip(self._offsets, self.params)
        ]
        return PartitionGradient(tensors, float(flat[self.grad_numel]))

    def flat(self, entry: Entry, dtype: Optional[torch.dtype] = None) -> Tensor:
        """``entry`` as one flat tensor (gradient, then the loss) in ``dtype`` (default the payload's): a new
        tensor, for a checkpoint or a correction that rewrites a stale entry (not on the step's path)."""
        dtype = dtype or self.dtype
        if isinstance(entry, Tensor):
            return entry[: self.grad_numel + 1].to(dtype)
        out = torch.empty(self.grad_numel + 1, dtype=dtype, device=self.device)
        self.encode({0: 1.0}, {0: entry}, out)
        return out

    def encode(self, coefficients: Mapping[int, float], entries: Mapping[int, Entry], out: Tensor) -> Tensor:
        """Write ``sum_j coefficients[j] * entries[j]`` (gradient and loss) into ``out[: grad_numel + 1]``, in the
        coefficients' order and ``out``'s dtype: per parameter one fused kernel for two terms, straight from the
        tensors backward produced (flat entries, e.g. corrected ones, are summed as one)."""
        order = list(coefficients)
        head = out.reshape(-1)[: self.grad_numel + 1]
        if any(isinstance(entries[j], Tensor) for j in order):
            return _linear_combination(head, [(self.flat(entries[j], out.dtype), coefficients[j]) for j in order])
        parts = [entries[j] for j in order]
        assert all(isinstance(e, PartitionGradient) for e in parts)
        for i, ((o, n), p) in enumerate(zip(self._offsets, self.params)):
            terms = []
            for e, j in zip(parts, order):
                g = e.tensors[i]  # type: ignore[union-attr]
                if g is not None:
                    terms.append((flat_like(g, p).to(head.device), coefficients[j]))
            step = n if all(t.dtype == out.dtype for t, _ in terms) else CONVERT_CHUNK
            for lo in range(0, n, step):  # (a conversion, e.g. to Tandon's float64, a chunk at a time)
                _linear_combination(head[o + lo : o + min(n, lo + step)], [(t[lo : lo + step], a) for t, a in terms])
        losses = [
            (torch.tensor([e.loss], dtype=out.dtype, device=out.device), coefficients[j])  # type: ignore[union-attr]
            for e, j in zip(parts, order)
        ]
        _linear_combination(head[self.grad_numel :], losses)
        return out

    def finite(self, code: Tensor, buffers: bool = True) -> bool:
        """Whether the payload in ``code`` is finite: gradient, loss and (with ``buffers``) the buffers (one read pass:
        a NaN or inf in any entry it sums reaches the sum)."""
        return bool(torch.isfinite(code.reshape(-1)[: self.numel if buffers else self.grad_numel + 1].sum()))

    def nonfinite(self, entries: Mapping[int, Entry]) -> list[int]:
        """The partitions of ``entries`` whose gradient or loss holds NaN or inf, sorted (a read of each: only once
        a code was found not finite)."""
        out = []
        for j in sorted(entries):
            e = entries[j]
            if isinstance(e, Tensor):
                bad = not bool(torch.isfinite(e[: self.grad_numel + 1].sum()))
            else:
                bad = not math.isfinite(e.loss) or any(
                    t is not None and not bool(torch.isfinite(t.sum())) for t in e.tensors
                )
            if bad:
                out.append(j)
        return out

    def flat_buffers(self, dtype: torch.dtype) -> Tensor:
        """The buffers, flat, on the payload's device (the payload's tail)."""
        return torch.cat([b.detach().reshape(-1).to(self.device, dtype) for b in self.buffers])

    def load_buffers(self, flat: Tensor) -> None:
        """Copy the aggregate's buffer tail into the buffers (integer buffers rounded)."""
        offset = 0
        for b in self.buffers:
            values = flat[offset : offset + b.numel()].view_as(b)
            if not b.dtype.is_floating_point:
                values = values.round()
            b.copy_(values.to(device=b.device, dtype=b.dtype))
            offset += b.numel()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def apply(self, gradient: Tensor) -> None:
        """Point ``param.grad`` at the aggregate (views on the aggregate's device; asynchronous copies from pinned
        memory otherwise): what clipping, callbacks and the optimizer then see."""
        for (offset, n), p in zip(self._offsets, self.params):
            if p.requires_grad:  # frozen now (e.g. by a finetuning callback): no gradient, as without PGC
                p.grad = grad_view(gradient[offset : offset + n], p).to(
                    device=p.device, dtype=p.dtype, non_blocking=True
                )
            else:
                p.grad = None

    def clear(self) -> None:
        """Forget this step's partitions (the fit ended, or a new one lays the payload out again)."""
        self.fresh = {}


def _dense_order(p: Tensor) -> Optional[list[int]]:
    """The dimensions of ``p`` from outermost to innermost in memory, if it is dense but not contiguous (e.g.
    channels_last), else None."""
    if p.is_contiguous() or p.dim() < 2:
        return None
    strides = p.stride()
    order = sorted(range(p.dim()), key=lambda d: (-strides[d], d))
    return order if p.permute(order).is_contiguous() else None


def flat_like(g: Tensor, p: Tensor) -> Tensor:
    """``g`` (a gradient of ``p``) flattened in ``p``'s memory order (a view when ``g`` has ``p``'s layout)."""
    order = _dense_order(p)
    return g.reshape(-1) if order is None else g.permute(order).reshape(-1)


def grad_view(segment: Tensor, p: Tensor) -> Tensor:
    """A flat segment of the aggregate as ``p``'s gradient, in ``p``'s layout (channels_last stays channels_last)."""
    order = _dense_order(p)
    if order is None:
        return segment.view_as(p)
    return segment.as_strided(p.shape, p.stride())
