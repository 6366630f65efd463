"""Training on a schedule: the parameters a real cluster would hold, version by version, in one process.

At every version ``t`` the emulator evaluates the mini-batch gradient of every partition ``j`` at the parameters
``theta_t`` on that partition's stream batch of step ``t`` (what any rank evaluating ``j`` at step ``t`` computes:
all replicas hold ``theta_t`` at step ``t``, and every holder of ``j`` draws the same batch). The ``n``
evaluations of one version share ``theta_t``, so they run as one ``torch.func.vmap`` of ``grad`` over the
per-partition batches. The aggregate of ``t`` then combines the gradients the version's admitted codes really
held, of versions ``t - age`` (:class:`~lightning_pgc.emulator.aggregate.AggregatePlan`; under bounded staleness
the partition gradients of the model versions the leader's plan names, :class:`~lightning_pgc.emulator.aggregate.BoundedPlan`),
and the optimizer applies it, as every replica does. The loss slot of the aggregate is the decoded training loss a
real run logs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from lightning_pgc.codes import Scheme
from lightning_pgc.sampling import PartitionStreams
from lightning_pgc.emulator.aggregate import plan_for
from lightning_pgc.emulator.running_stats import buffer_decay, next_statistics, used_codes
from lightning_pgc.emulator.schedule import Version
from lightning_pgc.staleness import StalenessCorrection, accounted_momentum, delay_compensate, nominal_mean_age

__all__ = ["EmulatedRun", "Task", "VersionAggregate", "emulate", "emulate_grid"]


@dataclass
class Task:
    """A classification or next-token task: ``model`` (its current parameters are the starting point), tensors of
    training and validation samples, and the samples per partition evaluation (``batch_size``). Loss:
    cross-entropy over every output position (``[b, classes]`` or ``[b, t, vocab]`` logits).

    ``optimizer``: ``"sgd"`` (a setting ``(lr, momentum)`` is ``torch.optim.SGD``'s) or ``"adamw"`` (a setting is
    ``lr`` and ``betas = (momentum, beta2)``, with ``weight_decay``); every arm of a task uses the same. A model with
    BatchNorm is trained with each partition's own batch statistics and its running statistics follow
    :mod:`lightning_pgc.emulator.running_stats` (:func:`emulate_grid` only)."""

    model: nn.Module
    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    batch_size: int
    optimizer: str = "sgd"
    weight_decay: float = 0.0
    beta2: float = 0.99

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if len(self.x_train) != len(self.y_train) or len(self.x_val) != len(self.y_val):
            raise ValueError("inputs and labels must have the same length")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.optimizer == "sgd" and self.weight_decay != 0.0:
            raise ValueError("weight_decay is a setting of the 'adamw' optimizer only")

    def make_optimizer(self, params: list[nn.Parameter], lr: float, momentum: float) -> torch.optim.Optimizer:
        """The task's optimizer at setting ``(lr, momentum)``."""
        if self.optimizer == "adamw":
            return torch.optim.AdamW(
                params, lr=lr, betas=(momentum, self.beta2), eps=ADAM_EPS, weight_decay=self.weight_decay
            )
        return torch.optim.SGD(params, lr=lr, momentum=momentum)


#: the optimizers a task may use
OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
#: AdamW's epsilon (torch's default)
ADAM_EPS: float = 1e-8


def task_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy over every output position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@dataclass
class EmulatedRun:
    """What one emulated run produced: per applied version its time and decoded training loss; the validation loss
    at the versions it was evaluated (``val_steps``: after applying that many versions); ``diverged`` if a loss or
    parameter became non-finite (the run stops there)."""

    times: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_times: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    diverged: bool = False
    params: Optional[Tensor] = None
    buffers: Optional[dict[str, Tensor]] = None  # the final running statistics (a model with BatchNorm)

    def time_to(self, target: float) -> Optional[float]:
        """Time at which the validation loss first reached ``target`` (``None``: never, within the run)."""
        for t, loss in zip(self.val_times, self.val_loss):
            if loss <= target:
                return t
        return None


def _flat(tensors: Sequence[Tensor], batch_dims: int = 0) -> Tensor:
    return torch.cat([t.reshape(*t.shape[:batch_dims], -1) for t in tensors], dim=-1)


def _compensated(
    corr: StalenessCorrection, terms: Sequence[tuple[int, int, float]], t: int, gradients: dict[int, Tensor], numel: int
) -> dict[int, Tensor]:
    """Under delay compensation: ``gradients`` with each stale entry the aggregate of ``t`` uses replaced by what a
    rank encodes for ``t`` (:meth:`StalenessCorrection.compensate`: it depends only on the partition, the entry's
    version and ``t``, not on which rank holds it). Otherwise ``gradients`` itself."""
    if corr.kind != "delay_compensation":
        return gradients
    out = dict(gradients)
    stale: dict[int, set[int]] = {}
    for v, j, _ in terms:
        if v < t:
            stale.setdefault(v, set()).add(j)
    for v, parts in stale.items():
        fixed = corr.compensate({j: gradients[v][j] for j in parts}, {j: v for j in parts}, t, numel)
        rows = gradients[v].clone()
        for j in parts:
            rows[j] = fixed[j]
        out[v] = rows
    return out


class VersionAggregate:
    """The aggregate of each version of ``schedule`` at the model's current parameters, as :func:`emulate` applies
    it: every partition's gradient at ``theta_t`` on its stream batch of step ``t`` (one ``vmap``), kept for as many
    versions as the plan reaches back, combined as the version's admitted codes held them (delay compensation
    applied to stale entries). Call it once per version, in order, with ``task.model`` at that version's parameters
    (what :func:`emulate` does; a validation against a real run sets the run's own parameters first).

    Args:
        corr: the fit's staleness correction (its snapshots of the parameters are taken here, one per version).
        start: the first version of the schedule.
    """

    def __init__(
        self,
        scheme: Scheme,
        schedule: Sequence[Version],
        task: Task,
        streams: PartitionStreams,
        corr: StalenessCorrection,
        start: int = 0,
    ) -> None:
        model = task.model
        self.task, self.streams, self.corr, self.n = task, streams, corr, scheme.n
        self.names = [name for name, _ in model.named_parameters()]
        self.params = list(model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.plan = plan_for(scheme, start)
        self.keep = self.plan.keep(schedule)  # versions of gradients the aggregates reach back
        buffers = {name: t for name, t in model.named_buffers()}
        if buffers:
            raise ValueError(
                f"{type(model).__name__} has buffers (BatchNorm): emulate them with emulate_grid, which replays "
                "every partition's batch statistics and the runtime's running statistics"
            )

        def loss_fn(weights: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
            return task_loss(functional_call(model, (weights, buffers), (x,)), y)

        self._per_partition = vmap(grad_and_value(loss_fn), in_dims=(None, 0, 0))
        self._gradients: dict[int, Tensor] = {}

    def __call__(self, entry: Version) -> Tensor:
        """The flat aggregate of ``entry`` (gradient, then the decoded loss), in float64."""
        t, params, task = entry.version, self.params, self.task
        index = torch.tensor([self.streams.batch(j, t, task.batch_size) for j in range(self.n)])  # [n, b]
        self.corr.begin_step(t, params)
        with self.corr.shifted(t, params):  # look-ahead: every fresh gradient at the extrapolated point
            weights = {name: p.detach() for name, p in zip(self.names, params)}
            grads, losses = self._per_partition(weights, task.x_train[index], task.y_train[index])
        gradients = self._gradients
        gradients[t] = torch.cat([_flat([grads[name] for name in self.names], 1), losses.reshape(self.n, 1)], dim=1)
        gradients.pop(t - self.keep, None)
        terms = self.plan.terms_of(entry)
        return self.plan.combine(terms, _compensated(self.corr, terms, t, gradients, self.numel))


def emulate(
    scheme: Scheme,
    schedule: Sequence[Version],
    task: Task,
    streams: PartitionStreams,
    lr: float,
    momentum: float,
    val_every: int = 1,
    stop_below: Optional[float] = None,
    start: int = 0,
    optimizer: Optional[Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = None,
    correction: str = "none",
    lookahead_steps: Optional[float] = None,
    dc_lambda: float = 0.04,
) -> EmulatedRun:
    """Train ``task.model`` in place on ``schedule`` (one entry per version, in order) with ``scheme``.

    Args:
        streams: the per-partition mini-batch streams (``streams.n == scheme.n``).
        lr, momentum: the setting of the task's optimizer (``Task.make_optimizer``; unless ``optimizer`` builds
            another from the parameters).
        val_every: versions between validation losses (1: after every version; also before the first).
        stop_below: stop once the validation loss is at or below this (time to target is known then).
        correction, lookahead_steps, dc_lambda: the staleness correction, as ``PGCStrategy`` takes it; applied with
            the strategy's own :class:`~lightning_pgc.staleness.StalenessCorrection` (``"momentum"`` lowers the
            optimizer's momentum at the start, ``"lookahead"`` evaluates every fresh gradient at the extrapolated
            point, ``"delay_compensation"`` corrects each stale entry by its age before it is encoded). Under the
            bounded scheme: ``"momentum"`` and ``"lookahead"`` (default ``k``: the nominal mean age), as the strategy.

    Raises:
        ValueError: ``streams`` for another ``n``, a schedule that does not fit the scheme, a correction for a
            scheme without stale entries, or delay compensation under the bounded scheme.
    """
    if streams.n != scheme.n:
        raise ValueError(f"streams split the data into {streams.n} partitions, the scheme has n={scheme.n}")
    if val_every < 1:
        raise ValueError(f"val_every must be >= 1, got {val_every}")
    model = task.model
    params = [p for p in model.parameters()]
    opt = optimizer(params) if optimizer is not None else task.make_optimizer(params, lr, momentum)
    corr = StalenessCorrection.for_fit(correction, scheme, [opt], lookahead=lookahead_steps, dc_lambda=dc_lambda)
    aggregate_of = VersionAggregate(scheme, schedule, task, streams, corr, start)
    run = EmulatedRun()

    def validate(steps: int, when: float) -> None:
        with torch.no_grad():
            loss = float(task_loss(model(task.x_val), task.y_val))
        run.val_steps.append(steps)
        run.val_times.append(when)
        run.val_loss.append(loss)

    validate(0, 0.0)
    for i, entry in enumerate(schedule):
        t = entry.version
        if t != start + i:
            raise ValueError(
                f"schedule entry {i} is version {t}, expected {start + i} (versions in order, none missing)"
            )
        aggregate = aggregate_of(entry)
        loss = float(aggregate[-1])
        offset = 0
        for p in params:
            p.grad = aggregate[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
        opt.step()
        run.times.append(entry.time_s)
        run.train_loss.append(loss)
        if not math.isfinite(loss) or not all(bool(torch.isfinite(p).all()) for p in params):
            run.diverged = True
            break
        if (i + 1) % val_every == 0 or i + 1 == len(schedule):
            validate(i + 1, entry.time_s)
            if not math.isfinite(run.val_loss[-1]):
                run.diverged = True
                break
            if stop_below is not None and run.val_loss[-1] <= stop_below:
                break
    run.params = torch.cat([p.detach().reshape(-1) for p in params])
    return run


def emulate_grid(
    scheme: Scheme,
    schedule: Sequence[Version],
    task: Task,
    streams: PartitionStreams,
    configs: Sequence[tuple[float, float]],
    stop_below: Optional[float] = None,
    start: int = 0,
    correction: str = "none",
    lookahead_steps: Optional[float] = None,
    dc_lambda: float = 0.04,
    val_every: int = 1,
) -> list[EmulatedRun]:
    """:func:`emulate` for several ``(lr, momentum)`` settings of the task's optimizer at once, on the same schedule.

    Every configuration starts from ``task.model``'s parameters (left untouched) and follows its own trajectory; the
    gradients of all configurations and partitions of a version are one ``vmap`` over configurations of a ``vmap``
    over partitions. SGD with momentum is applied as ``torch.optim.SGD`` does (``buf = m buf + g``, first step
    ``buf = g``; ``theta -= lr buf``), AdamW as ``torch.optim.AdamW`` does (``betas = (momentum, task.beta2)``).
    The validation loss is taken before the first version and after every ``val_every`` versions (and after the
    last). A configuration whose loss becomes non-finite is marked ``diverged``; the batch stops once every
    configuration is at or below ``stop_below`` or diverged.

    A model with BatchNorm: every partition's forward uses its own batch statistics (in train mode), the running
    statistics follow :mod:`~lightning_pgc.emulator.running_stats` per configuration, and the validation loss is
    the eval-mode model's with them.

    ``correction`` (with ``lookahead_steps``, ``dc_lambda``) is applied as in :func:`emulate`, batched over the
    configurations: ``"momentum"`` runs each configuration at :func:`~lightning_pgc.staleness.accounted_momentum` of
    its momentum (the configurations stay labelled by the momentum the user chose), ``"lookahead"`` shifts all
    configurations' parameters with one :class:`~lightning_pgc.staleness.StalenessCorrection`, and
    ``"delay_compensation"`` corrects every configuration's stale entries with
    :func:`~lightning_pgc.staleness.delay_compensate` (not under the bounded scheme, as in :func:`emulate`).
    """
    if streams.n != scheme.n:
        raise ValueError(f"streams split the data into {streams.n} partitions, the scheme has n={scheme.n}")
    if not configs:
        raise ValueError("configs must list at least one (lr, momentum)")
    if val_every < 1:
        raise ValueError(f"val_every must be >= 1, got {val_every}")
    model = task.model
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    m = len(configs)
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).repeat(m, 1)  # [m, P]
    lr = torch.tensor([float(c[0]) for c in configs]).reshape(m, 1)
    corr = StalenessCorrection.for_fit(correction, scheme, [], lookahead=lookahead_steps, dc_lambda=dc_lambda)
    if correction == "momentum":  # what StalenessCorrection.for_fit does to an optimizer, per configuration
        configs = [(lr_, accounted_momentum(m_, nominal_mean_age(scheme))) for lr_, m_ in configs]
    mom = torch.tensor([float(c[1]) for c in configs]).reshape(m, 1)
    decay = buffer_decay(model)
    n, b = scheme.n, task.batch_size
    #: running statistics per configuration ([m, ...]) and one update per partition ([n, m, ...]), by version
    stats: dict[int, dict[str, Tensor]] = {
        start: {name: t.detach().unsqueeze(0).repeat(m, *([1] * t.dim())) for name, t in model.named_buffers()}
    }
    steps: dict[int, dict[str, Tensor]] = {}
    was_training = model.training

    def unflat(flat: Tensor) -> dict[str, Tensor]:
        return {name: t.view(shape) for name, t, shape in zip(names, flat.split(sizes), shapes)}

    def loss_fn(flat: Tensor, bufs: dict[str, Tensor], x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        local = {name: t.clone() for name, t in bufs.items()}  # the forward updates them in place
        return task_loss(functional_call(model, (unflat(flat), local), (x,)), y), local

    def val_loss(flat: Tensor, bufs: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return task_loss(functional_call(model, (unflat(flat), bufs), (x,)), y)

    grads_fn = vmap(vmap(grad_and_value(loss_fn, has_aux=True), in_dims=(None, 0, 0, 0)), in_dims=(0, 0, None, None))
    val_fn = vmap(val_loss, in_dims=(0, 0, None, None))
    plan = plan_for(scheme, start)
    keep = plan.keep(schedule)
    runs = [EmulatedRun() for _ in range(m)]
    done = [False] * m
    current = start
    buf: Optional[Tensor] = None
    exp_avg_sq: Optional[Tensor] = None

    def validate(steps_done: int, when: float) -> None:
        model.eval()
        with torch.no_grad():
            losses = val_fn(theta, stats[current], task.x_val, task.y_val).tolist()
        for k, run in enumerate(runs):
            if done[k]:
                continue
            run.val_steps.append(steps_done)
            run.val_times.append(when)
            run.val_loss.append(losses[k])
            if not math.isfinite(losses[k]):
                run.diverged = done[k] = True
            elif stop_below is not None and losses[k] <= stop_below:
                done[k] = True

    try:
        validate(0, 0.0)
        gradients: dict[int, Tensor] = {}
        for i, entry in enumerate(schedule):
            if all(done):
                break
            t = entry.version
            if t != start + i:
                raise ValueError(
                    f"schedule entry {i} is version {t}, expected {start + i} (versions in order, none missing)"
                )
            index = torch.tensor([streams.batch(j, t, b) for j in range(n)])
            expanded = {name: r.unsqueeze(1).expand(m, n, *r.shape[1:]) for name, r in stats[t].items()}
            corr.begin_step(t, [theta])
            model.train()
            with corr.shifted(t, [theta]):  # look-ahead: in place, restored bit for bit after
                grads, (losses, updated) = grads_fn(theta, expanded, task.x_train[index], task.y_train[index])
            # grads [m, n, P], losses [m, n]
            gradients[t] = torch.cat([grads, losses.unsqueeze(-1)], dim=-1).transpose(0, 1).reshape(n, -1)
            gradients.pop(t - keep, None)
            terms = plan.terms_of(entry)
            used = gradients
            if corr.kind == "delay_compensation":
                used = dict(gradients)
                for v in {v for v, _, _ in terms if v < t}:
                    d = corr.displacement(t, v)
                    if d is None:
                        continue
                    rows = gradients[v].reshape(n, m, -1).clone()
                    rows[..., :-1] = delay_compensate(rows[..., :-1], d.reshape(m, -1), corr.dc_lambda)
                    used[v] = rows.reshape(n, -1)
            aggregate = plan.combine(terms, used, dtype=torch.float32).reshape(m, -1)
            g = aggregate[:, :-1].to(theta.dtype)
            if task.optimizer == "adamw":
                buf, exp_avg_sq = _adamw_step(theta, g, buf, exp_avg_sq, i + 1, lr, mom, task)
            else:
                buf = g.clone() if buf is None else buf.mul_(mom).add_(g)
                theta.sub_(lr * buf)
            if decay:
                steps[t] = {name: (u - stats[t][name].unsqueeze(1)).transpose(0, 1) for name, u in updated.items()}
                stats[t + 1] = next_statistics(used_codes(scheme, entry, start), stats, steps, decay)
            else:
                stats[t + 1] = {}
            stats.pop(t + 1 - keep, None)
            steps.pop(t + 1 - keep, None)
            current = t + 1
            for k, run in enumerate(runs):
                if not done[k]:
                    run.times.append(entry.time_s)
                    run.train_loss.append(float(aggregate[k, -1]))
            if (i + 1) % val_every == 0 or i + 1 == len(schedule):
                validate(i + 1, entry.time_s)
    finally:
        model.train(was_training)
    for k, run in enumerate(runs):
        run.params = theta[k].clone()
        if decay:
            run.buffers = {name: r[k].clone() for name, r in stats[current].items()}
    return runs


def _adamw_step(
    theta: Tensor,
    g: Tensor,
    exp_avg: Optional[Tensor],
    exp_avg_sq: Optional[Tensor],
    step: int,
    lr: Tensor,
    beta1: Tensor,
    task: Task,
) -> tuple[Tensor, Tensor]:
    """One ``torch.optim.AdamW`` step of every configuration (rows of ``theta``), in place; returns its state."""
    if exp_avg is None or exp_avg_sq is None:
        exp_avg, exp_avg_sq = torch.zeros_like(theta), torch.zeros_like(theta)
    theta.mul_(1 - lr * task.weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(task.beta2).addcmul_(g, g, value=1 - task.beta2)
    bias1 = 1 - beta1**step
    bias2 = 1 - task.beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(ADAM_EPS)
    theta.sub_((lr / bias1) * exp_avg / denom)
    return exp_avg, exp_avg_sq
