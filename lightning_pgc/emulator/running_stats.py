"""BatchNorm's running statistics in the one-process emulator, as the strategy forms them.

In a real run every rank computes its training forward passes with its own batch statistics (one forward per
partition it evaluates at step ``t``, in the scheme's order, from the parameters ``theta_t`` and the running
statistics ``r_t`` every replica shares), which updates its running statistics; its code carries them in the
payload's tail, and the aggregate's tail is the **plain mean over the codes the aggregate uses**
(:func:`lightning_pgc.codes.shares.reference_decode`), which every replica loads as ``r_(t+1)``.

BatchNorm's update of a running statistic with momentum ``m`` is ``U_j(x) = (1 - m) x + m b_j`` (``b_j``: the
statistic of partition ``j``'s batch; ``num_batches_tracked`` adds 1), an affine map, so from the emulator's one
forward per partition at ``r_t`` (``u_j = U_j(r_t)``, ``d_j = u_j - r_t``) a rank that evaluates ``j_1, ..., j_c``
ends at ``r_t + sum_i (1 - m)^(c - i) d_(j_i)``. The emulator therefore reproduces the strategy exactly:

- the coded and pipelined schemes: the used codes are those of the version's admitted ranks, each built at ``t``
  after the rank's :meth:`~lightning_pgc.codes.Scheme.evaluations` of ``t``;
- bounded staleness: the plan's entries ``(partition i, rank, version v)``, each a code built at ``v`` after one
  forward on ``i`` (``r_v + d_i`` of version ``v``); the emulator keeps ``r`` and ``d`` for as many versions as it
  keeps gradients.

Running statistics do not change a training step (training forwards use batch statistics); they set the
eval-mode model whose held-out loss is the emulator's validation loss.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor, nn

from lightning_pgc.codes import Scheme
from lightning_pgc.codes.bounded import BoundedScheme
from lightning_pgc.emulator.schedule import Version

__all__ = ["buffer_decay", "used_codes", "next_statistics"]


def buffer_decay(model: nn.Module) -> dict[str, float]:
    """Per buffer of ``model``, the factor ``U_j`` applies to the previous value: ``1 - momentum`` for a BatchNorm
    running mean or variance, 1 for its ``num_batches_tracked``.

    Raises:
        ValueError: a buffer that is not a BatchNorm running statistic, or a BatchNorm with ``momentum=None`` (a
            cumulative average, not an affine update of the previous value alone).
    """
    out: dict[str, float] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            if module.momentum is None:
                raise ValueError(f"BatchNorm {prefix!r} has momentum=None; the emulator needs a fixed momentum")
            key = f"{prefix}." if prefix else ""
            out[key + "running_mean"] = 1.0 - float(module.momentum)
            out[key + "running_var"] = 1.0 - float(module.momentum)
            out[key + "num_batches_tracked"] = 1.0
    unknown = [name for name, _ in model.named_buffers() if name not in out]
    if unknown:
        raise ValueError(
            f"the emulator replays BatchNorm running statistics only; {type(model).__name__} has other buffers "
            f"{unknown}"
        )
    return out


def used_codes(scheme: Scheme, entry: Version, start: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    """``(model version, partitions evaluated before the code, in order)`` of every code the aggregate of
    ``entry`` uses (the codes whose buffer tails it averages)."""
    if isinstance(scheme, BoundedScheme):
        if entry.plan is None:
            raise ValueError(f"version {entry.version}: a bounded version needs its leader's plan")
        return [(v, (i,)) for i, k, v in entry.plan if k >= 0]
    return [(entry.version, tuple(scheme.evaluations(k, entry.version, start))) for k in entry.admitted]


def next_statistics(
    codes: Sequence[tuple[int, tuple[int, ...]]],
    stats: Mapping[int, Mapping[str, Tensor]],
    steps: Mapping[int, Mapping[str, Tensor]],
    decay: Mapping[str, float],
) -> dict[str, Tensor]:
    """The running statistics every replica loads: the mean over ``codes`` of ``r_v + sum_i decay^(c-i) d_v[j_i]``.

    ``stats[v][name]``: ``r_v`` (any leading batch shape ``S``); ``steps[v][name]``: ``d_v``, shaped ``[n, *S, ...]``
    (row ``j``: one update with partition ``j``'s batch, minus ``r_v``).
    """
    if not codes:
        raise ValueError("an aggregate uses at least one code")
    out: dict[str, Tensor] = {}
    for name, factor in decay.items():
        total = None
        for v, parts in codes:
            value = stats[v][name].to(torch.float64)
            for i, j in enumerate(parts):
                value = value + factor ** (len(parts) - 1 - i) * steps[v][name][j].to(torch.float64)
            total = value if total is None else total + value
        assert total is not None
        mean = total / len(codes)
        ref = stats[codes[0][0]][name]
        out[name] = mean.round().to(ref.dtype) if not ref.dtype.is_floating_point else mean.to(ref.dtype)
    return out
