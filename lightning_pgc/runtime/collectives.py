"""Lightning's collectives among the live ranks: barrier, broadcast, reduce and all-gather over a gather.

Lightning's own collectives during fit (validation ``sync_dist`` reduces, checkpoint barriers and broadcasts,
``reduce_boolean_decision``) run on the default process group, which needs every rank: one dead rank makes them
fail or hang. While the runtime runs they go through :meth:`~lightning_pgc.runtime.plane.CollectiveRuntime.gather`
instead (an all-gather among the members of the data group, in the order the leader sets), and every rank combines
the same contributions in rank order, so the results are bit-identical everywhere.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["CollectiveError", "Contribution", "Gather", "LiveCollectives"]

#: One rank's part of one collective, as the runtime carries it: the operation's name and the rank's object.
Contribution = tuple[str, object]


class CollectiveError(RuntimeError):
    """A collective among the live ranks could not complete (mismatched calls, a source rank gone)."""


class Gather(Protocol):
    """Every live rank's contribution to one collective, by rank (what :class:`LiveCollectives` builds on)."""

    rank: int
    world_size: int

    def gather(self, op: str, obj: Any) -> dict[int, Any]: ...


class LiveCollectives:
    """Barrier, broadcast, reduce and all-gather over a :class:`Gather` (the live ranks only).

    Raises (each method):
        CollectiveError: a broadcast whose source is gone, or an all-gather while ranks are missing (its result
            would not have ``world_size`` rows).
    """

    def __init__(self, gather: Gather) -> None:
        self.gather = gather

    def barrier(self) -> None:
        self.gather.gather("barrier", None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        got = self.gather.gather("broadcast", obj if self.gather.rank == src else None)
        if src not in got:
            raise CollectiveError(
                f"broadcast from rank {src}, which is no longer in the job (ranks left: {sorted(got)})"
            )
        return got[src]

    def reduce(self, tensor: Tensor, reduce_op: Any = "mean") -> Tensor:
        """``sum``, ``mean``/``avg``, ``max``, ``min`` or ``product`` over the live ranks (mean: their number)."""
        op = _op_name(reduce_op)
        got = self.gather.gather("reduce", tensor.detach().to("cpu"))
        values = torch.stack([got[r] for r in sorted(got)])
        if op in ("sum", "mean", "avg"):
            out = values.sum(0)
            if op != "sum":
                out = out / len(got)
        elif op == "max":
            out = values.amax(0)
        elif op == "min":
            out = values.amin(0)
        elif op == "product":
            out = values.prod(0)
        else:
            raise CollectiveError(f"reduce op {reduce_op!r} is not supported by the PGC live-rank reduce")
        return out.to(device=tensor.device, dtype=out.dtype if op in ("mean", "avg") else tensor.dtype)

    def all_gather(self, tensor: Tensor) -> Tensor:
        got = self.gather.gather("all_gather", tensor.detach().to("cpu"))
        missing = [r for r in range(self.gather.world_size) if r not in got]
        if missing:
            raise CollectiveError(
                f"all_gather while ranks {missing} are gone: the result would lack their rows; "
                "gather only where every rank is alive, or use a reduce"
            )
        return torch.stack([got[r] for r in range(self.gather.world_size)]).to(tensor.device)


def _op_name(reduce_op: Any) -> str:
    """``"sum"``, ``"mean"`` ... from a string or a ``torch.distributed.ReduceOp``."""
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        return reduce_op.lower()
    name = getattr(reduce_op, "name", None) or str(reduce_op).rsplit(".", 1)[-1]
    return {"AVG": "avg", "SUM": "sum", "MAX": "max", "MIN": "min", "PRODUCT": "product"}.get(
        name.upper(), name.lower()
    )
