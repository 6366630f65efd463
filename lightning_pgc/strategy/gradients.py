"""Gradients: the flat payload layout of one fit, the stale cache's slots, and moving gradients in and out of it.

A rank's payload is one flat tensor: every parameter's gradient in the parameters' order (each in its parameter's
memory order, so a ``channels_last`` weight is copied without a permute), then the loss, then the buffers
(BatchNorm statistics, averaged like the gradient so that the replicas stay identical). Each held partition has a
preallocated slot of that layout on the model's device: the stale cache's storage, filled by :meth:`Gradients.store`
from ``param.grad``, encoded and all-reduced there; :meth:`Gradients.apply` points ``param.grad`` at the aggregate.

No Lightning and no ``torch.distributed``: the strategy builds one per fit from its module's parameters.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_pgc.runtime.aggregates import payload_dtype_for

__all__ = ["Gradients", "flat_like", "grad_view"]


class Gradients:
    """The parameters and buffers of one fit, laid out as one flat payload, and one slot per held partition.

    Args:
        params: every parameter of the module, frozen ones included (finetuning callbacks flip ``requires_grad``
            mid-fit: a layout fixed at the start keeps the payload and the stale cache valid on every rank; a frozen
            parameter sends zeros and gets no gradient).
        buffers: the buffers that travel with the payload (non-empty ones).
        device: where the slots live (the model's device: the encode and the all-reduce read them there).
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
        self.slots: dict[int, Tensor] = {}  # partition -> preallocated flat gradient (the stale cache's storage)
        self.fresh: set[int] = set()  # partitions stored since :meth:`begin_step`

    @classmethod
    def of(cls, module: torch.nn.Module, device: torch.device) -> Gradients:
        """The layout of ``module``: all its parameters, and its non-empty buffers."""
        return cls(list(module.parameters()), [b for b in module.buffers() if b.numel() > 0], device)

    @property
    def nbytes(self) -> int:
        """Bytes of one payload."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def slot(self, partition: int) -> Tensor:
        """The preallocated flat gradient of ``partition`` (created at the first use)."""
        slot = self.slots.get(partition)
        if slot is None:
            slot = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            self.slots[partition] = slot
        return slot

    def begin_step(self) -> None:
        """A new step: nothing stored yet, and no ``param.grad`` (it may view the previous aggregate: never
        accumulate into it)."""
        self.fresh = set()
        self.zero_grad()

    def store(self, partition: int, loss: Optional[Tensor]) -> None:
        """Copy ``param.grad`` and the loss into the slot of ``partition`` (the one full-size copy)."""
        slot = self.slot(partition)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        target = slot[: self.grad_numel]
        if grads and all(g.device == slot.device and g.dtype == slot.dtype for g in grads):
            torch.cat([flat_like(g, p) for g, p in zip(grads, self.params)], out=target)  # one kernel, no host copy
        else:
            offset = 0
            for g in grads:
                target[offset : offset + g.numel()].copy_(g.detach().reshape(-1), non_blocking=True)
                offset += g.numel()
            if any(g.device.type == "cuda" for g in grads):
                torch.cuda.current_stream().synchronize()  # the pinned slot is read by another thread next
        slot[self.grad_numel] = 0.0 if loss is None else float(loss.detach())
        self.fresh.add(partition)

    def nonfinite(self) -> list[int]:
        """The partitions stored this step whose slot holds NaN or inf (one read pass each), sorted."""
        return sorted(p for p in self.fresh if not bool(torch.isfinite(self.slots[p].sum())))

    def flat_buffers(self, dtype: torch.dtype) -> Tensor:
        """The buffers, flat, on the slots' device (the payload's tail)."""
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
        """Point ``param.grad`` at the aggregate (views on CPU; asynchronous copies from pinned memory on CUDA):
        what clipping, callbacks and the optimizer then see."""
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.requires_grad:  # frozen now (e.g. by a finetuning callback): no gradient, as without PGC
                p.grad = grad_view(gradient[offset : offset + n], p).to(
                    device=p.device, dtype=p.dtype, non_blocking=True
                )
            else:
                p.grad = None
            offset += n

    def clear(self) -> None:
        """Drop the slots (the fit ended, or a new one lays them out again)."""
        self.slots = {}
        self.fresh = set()


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
