"""Running the user's ``training_step`` off the record, for measurements on a fixed probe batch.

The diagnostics and the staleness valve evaluate the training loss and its gradient at the current (or a past)
model version without leaving a trace in the run: gradients, buffers, torchmetrics states, RNG and logs are as
before, and collectives are refused under PGC as in the real step. :func:`log_at` logs a measurement at the step
it was taken.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor
from torch.utils.data import default_collate

from lightning_pgc.sampling import PartitionBatchSampler


__all__ = [
    "CoordinateSample",
    "collate",
    "flat_params",
    "log_at",
    "loss_and_gradient",
    "loss_gradient",
    "partition_loader",
    "reduced_gradient",
    "squared_norm",
    "probe_loss",
    "swapped_params",
    "untouched",
]


def log_at(trainer: Trainer, metrics: dict[str, float], step: int) -> None:
    """Log ``metrics`` once, at ``step``, to every logger of the trainer (rank 0's loggers are the live ones)."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def flat_params(module: torch.nn.Module) -> Tensor:
    """Every parameter, frozen ones included, so the layout survives a finetuning callback's unfreezing."""
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in module.parameters()])


def loss_gradient(pl_module: LightningModule, batch: Any) -> Tensor:
    """Flat float64 gradient of ``training_step(batch)``'s loss, leaving no trace (grads, buffers, RNG, logs)."""
    return loss_and_gradient(pl_module, batch)[1]


def loss_and_gradient(pl_module: LightningModule, batch: Any) -> tuple[float, Tensor]:
    """``training_step(batch)``'s loss and its flat float64 gradient over every parameter (zeros for frozen ones),
    leaving no trace (grads, buffers, metric states, RNG, logs)."""
    params = list(pl_module.parameters())
    trainable = [p for p in params if p.requires_grad]
    batch = apply_to_collection(batch, Tensor, lambda t: t.to(pl_module.device))
    with untouched(pl_module), torch.enable_grad():
        output = pl_module.training_step(batch, 0)
        loss = _loss_of(output)
        grads = dict(zip(map(id, trainable), torch.autograd.grad(loss, trainable, allow_unused=True)))
    flat = [_or_zeros(grads.get(id(p)), p) for p in params]
    return float(loss.detach()), torch.cat([g.detach().reshape(-1).double().cpu() for g in flat])


def reduced_gradient(
    pl_module: LightningModule, batch: Any, reduce: Callable[[int, Tensor, int], None], chunk: int = 1 << 18
) -> float:
    """``training_step(batch)``'s loss; ``reduce(i, g, start)`` receives parameter ``i``'s gradient as backward
    produces it, rows ``start`` to ``start + len(g)`` of it (``start`` 0 and the whole gradient but for the weights
    below), which is then dropped: no model-sized buffer is held (``param.grad`` is untouched; a parameter without a
    gradient is not passed). Leaves no trace, as :func:`loss_and_gradient`.

    The weight of a plain ``nn.Linear`` (not shared with another module) is never materialized: backward is not asked
    for it, so autograd skips its product, and its gradient ``sum_b gout_b x_b^T`` is formed from the layer's inputs
    and output gradients ``chunk`` elements at a time. Its first layer is most of an MLP: a whole weight gradient
    there was a transient of nearly a model's size on the leader."""
    params = list(pl_module.parameters())
    taps = _LinearTaps(pl_module, params)
    trainable = [(i, p) for i, p in enumerate(params) if p.requires_grad and i not in taps.indices]

    def hook(i: int, g: Tensor) -> Tensor:
        reduce(i, g, 0)
        return g.new_zeros(()).expand_as(g)  # what autograd.grad returns: no memory

    handles = [p.register_hook(lambda g, i=i: hook(i, g)) for i, p in trainable]
    batch = apply_to_collection(batch, Tensor, lambda t: t.to(pl_module.device))
    try:
        with untouched(pl_module), torch.enable_grad(), taps:
            loss = _loss_of(pl_module.training_step(batch, 0))
            torch.autograd.grad(loss, [taps.anchor, *(p for _, p in trainable)], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    taps.reduce(reduce, chunk)
    return float(loss.detach())


class _LinearTaps:
    """The inputs and output gradients of every tapped ``nn.Linear`` in one forward and backward (see
    :func:`reduced_gradient`), and their weight gradients, a block of rows at a time.

    Each output is passed on as ``output + anchor`` (``anchor`` a zero scalar that backward is asked for): its
    gradient is then computed even where nothing else upstream needs it (a first layer without bias), and a hook on
    it sees the output's gradient (also when a later in-place op rewrites that tensor)."""

    def __init__(self, module: torch.nn.Module, params: Sequence[Tensor]) -> None:
        uses: dict[int, int] = {}
        for _, p in module.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        index = {id(p): i for i, p in enumerate(params)}
        self._layers = [
            (m, index[id(m.weight)])
            for m in module.modules()
            if isinstance(m, torch.nn.Linear)
            and type(m).forward is torch.nn.Linear.forward
            and isinstance(m.weight, torch.nn.Parameter)
            and m.weight.requires_grad
            and uses.get(id(m.weight)) == 1
            and id(m.weight) in index
        ]
        self.indices = {i for _, i in self._layers}
        self.anchor = torch.zeros((), requires_grad=True)
        self._seen: dict[int, list[tuple[Tensor, list[Tensor], int]]] = {i: [] for i in self.indices}
        self._handles: list[Any] = []

    def __enter__(self) -> "_LinearTaps":
        for m, i in self._layers:
            self._handles.append(m.register_forward_hook(lambda m, args, out, i=i: self._tap(i, args[0], out)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _tap(self, i: int, x: Tensor, out: Tensor) -> Optional[Tensor]:
        if not out.requires_grad:  # (under no_grad: no gradient from this use)
            return None
        grads: list[Tensor] = []
        self._seen[i].append((x.detach(), grads, x._version))
        tapped = out + self.anchor.to(out.device, out.dtype)
        tapped.register_hook(lambda g: grads.append(g.detach()))
        return tapped

    def reduce(self, reduce: Callable[[int, Tensor, int], None], chunk: int) -> None:
        """Hand each tapped weight's gradient to ``reduce`` in blocks of rows, summed over the layer's uses."""
        for m, i in self._layers:
            used = [(x, grads[0]) for x, grads, _ in self._seen[i] if grads]
            if not used:
                continue
            if any(x._version != version for x, _, version in self._seen[i]):
                raise RuntimeError(
                    f"the input of {type(m).__name__} (parameter {i}) was modified in place after the layer read it: "
                    "the probe cannot form its weight gradient (autograd would refuse it too)"
                )
            inputs = _rows([x for x, _ in used])
            outputs = _rows([g for _, g in used])
            inputs = inputs.to(outputs.dtype)
            rows = max(1, chunk // max(1, inputs.shape[1]))
            for start in range(0, outputs.shape[1], rows):
                block = outputs[:, start : start + rows].t() @ inputs
                reduce(i, block.to(m.weight.dtype), start)
        self._seen = {i: [] for i in self.indices}


def _rows(ts: Sequence[Tensor]) -> Tensor:
    """The tensors as one matrix of rows (their last dimension): a view for one use, a copy for several."""
    flat = [t.reshape(-1, t.shape[-1]) for t in ts]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def squared_norm(t: Tensor, chunk: int = 1 << 18) -> float:
    """``|t|^2`` accumulated in float64, a chunk at a time (no float64 copy of the whole tensor)."""
    t = t.detach()
    if t.dim() == 0 or t.numel() <= chunk:
        return float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
    rows = max(1, chunk // max(1, t[0].numel()))  # (views along the first dimension: any layout, no copy)
    return sum(float(torch.linalg.vector_norm(piece, dtype=torch.float64)) ** 2 for piece in t.split(rows))


class CoordinateSample:
    """A fixed, seeded subset of ``size`` of the ``N`` coordinates of a module's parameters, for norms of model-sized
    differences without holding model-sized vectors.

    ``sq(x)`` estimates ``|d|^2`` from ``x``, the sampled coordinates of ``d``, as ``N/k sum x_i^2``: unbiased
    (sampling without replacement), with the relative standard error ``rse(x)`` estimated from the sample itself,
    ``sqrt((1 - k/N) var(x_i^2) / k) / mean(x_i^2)``. With ``size >= N`` every coordinate is taken: exact, error 0.
    """

    def __init__(self, params: Sequence[Tensor], size: int, seed: int = 0) -> None:
        numels = [p.numel() for p in params]
        self.numel = sum(numels)
        self.size = min(int(size), self.numel)
        self.exact = self.size == self.numel
        index = (
            np.arange(self.numel)
            if self.exact
            else np.sort(np.random.default_rng(seed).choice(self.numel, size=self.size, replace=False))
        )
        self._index = torch.from_numpy(index)
        bounds = np.cumsum([0, *numels])
        # per parameter: its sampled coordinates as an index per dimension (None: all of them), so any layout of a
        # value or a gradient is read in place
        self._local: list[Optional[tuple[Tensor, ...]]] = []
        self._flat: list[Tensor] = []  # per parameter: its sampled coordinates as flat (row-major) offsets
        for p, lo, hi in zip(params, bounds[:-1], bounds[1:]):
            part = torch.from_numpy(index[np.searchsorted(index, lo) : np.searchsorted(index, hi)] - lo)
            whole = len(part) == hi - lo
            self._local.append(None if whole else tuple(torch.unravel_index(part, tuple(p.shape))))
            self._flat.append(part)

    def of(self, i: int, t: Tensor, p: Tensor) -> Tensor:
        """The sampled coordinates of ``t`` (parameter ``i`` ``p``'s value or gradient), float64 on the CPU."""
        t = t.detach()
        local = self._local[i]
        part = t.reshape(-1) if local is None else t[tuple(ix.to(t.device) for ix in local)]
        return part.to(device="cpu", dtype=torch.float64)

    def of_rows(self, i: int, t: Tensor, start: int, p: Tensor) -> Tensor:
        """The sampled coordinates in rows ``start`` to ``start + len(t)`` of parameter ``i`` (``p``), read from
        ``t``, those rows (the whole value when ``t`` has ``p``'s shape): the pieces of consecutive blocks of rows,
        in order, are :meth:`of` the whole."""
        if t.shape == p.shape:
            return self.of(i, t, p)
        row = p[0].numel()
        flat = self._flat[i]
        lo, hi = start * row, start * row + t.numel()
        part = flat[int(torch.searchsorted(flat, lo)) : int(torch.searchsorted(flat, hi))] - lo
        return t.detach().reshape(-1)[part.to(t.device)].to(device="cpu", dtype=torch.float64)

    def of_params(self, params: Sequence[Tensor]) -> Tensor:
        """The sampled coordinates of every parameter's value."""
        return torch.cat([self.of(i, p, p) for i, p in enumerate(params)])

    def of_flat(self, t: Tensor) -> Tensor:
        """The sampled coordinates of a flat vector laid out as the parameters are, in order (an aggregate)."""
        t = t.detach().reshape(-1)
        part = t if self.exact else t[self._index.to(t.device)]
        return part.to(device="cpu", dtype=torch.float64)

    @property
    def scale(self) -> float:
        """``N / k``: what a sum over the sampled coordinates is multiplied by to estimate the sum over all."""
        return self.numel / max(self.size, 1)

    def sq(self, x: Tensor) -> float:
        """The estimate of the squared norm of the vector whose sampled coordinates are ``x``."""
        return float(x.pow(2).sum()) * self.scale

    def rse(self, x: Tensor) -> float:
        """The estimated relative standard error of :meth:`sq` (0 when exact)."""
        if self.exact or self.size < 2:
            return 0.0
        y = x.pow(2)
        mean = float(y.mean())
        if mean <= 0:
            return 0.0
        return float((1 - self.size / self.numel) ** 0.5 * float(y.std()) / (self.size**0.5) / mean)


def _or_zeros(grad: Optional[Tensor], param: Tensor) -> Tensor:
    return grad if grad is not None else torch.zeros_like(param)


def _loss_of(output: Any) -> Tensor:
    """The loss tensor of a ``training_step`` output (the tensor itself, or a mapping's ``"loss"``)."""
    loss = output["loss"] if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise TypeError(f"a probe needs training_step to return a loss tensor (or a dict with 'loss'), got {output!r}")
    return loss


def probe_loss(pl_module: LightningModule, batch: Any) -> float:
    """``training_step(batch)``'s loss at the current parameters, without autograd, leaving no trace."""
    batch = apply_to_collection(batch, Tensor, lambda t: t.to(pl_module.device))
    with untouched(pl_module), torch.no_grad():
        output = pl_module.training_step(batch, 0)
        loss = _loss_of(output)
    return float(loss.detach())


@contextmanager
def untouched(pl_module: LightningModule) -> Iterator[None]:
    """Run the user's training_step off the record: RNG forked, logs muted, collectives refused (under PGC), buffers
    and torchmetrics states restored afterwards (a probe call on rank 0 must not count in a metric or move
    BatchNorm statistics)."""
    buffers = [b.detach().clone() for b in pl_module.buffers()]
    metrics = _metric_states(pl_module)
    with torch.random.fork_rng(devices=[]), _muted(pl_module), _guarded(pl_module):
        try:
            yield
        finally:
            for b, saved in zip(pl_module.buffers(), buffers):
                b.data.copy_(saved)
            for metric, state in metrics:
                for name, value in state.items():
                    setattr(metric, name, value)


@contextmanager
def _guarded(pl_module: LightningModule) -> Iterator[None]:
    """Under PGC, refuse collectives in a probe call of training_step as in the real one (it runs on one rank)."""
    try:
        guard = getattr(pl_module.trainer.strategy, "collective_guard", None)
    except RuntimeError:  # not attached to a Trainer
        guard = None
    if guard is None:
        yield
    else:
        with guard(pl_module):
            yield


def _metric_states(module: torch.nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    """A copy of every torchmetrics metric's state (its ``_defaults`` names and update bookkeeping)."""
    saved = []
    for sub in module.modules():
        defaults = getattr(sub, "_defaults", None)
        if isinstance(defaults, dict) and hasattr(sub, "_update_count"):
            names = [*defaults, "_update_count", "_computed", "_forward_cache"]
            saved.append((sub, {n: copy.deepcopy(getattr(sub, n, None)) for n in names if hasattr(sub, n)}))
    return saved


@contextmanager
def swapped_params(params: Sequence[torch.nn.Parameter], flat: Tensor) -> Iterator[None]:
    """Temporarily point every parameter's data at the values in ``flat`` (float64, from ``flat_params``).

    The original tensors are put back untouched, so the run's parameters (and the optimizer's references to them)
    are bit-for-bit unchanged afterwards.
    """
    saved = [p.data for p in params]
    offset = 0
    try:
        for p in params:
            size = p.numel()
            p.data = flat[offset : offset + size].view_as(p).to(device=p.device, dtype=p.dtype).clone()
            offset += size
        yield
    finally:
        for p, data in zip(params, saved):
            p.data = data


def partition_loader(trainer: Trainer) -> Optional[tuple[Any, Any]]:
    """``(DataLoader, PartitionBatchSampler)`` of the running fit, or ``None`` when the strategy is not PGC's."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = list(combined.flattened) if combined is not None else []
    if not loaders and trainer.train_dataloader is not None:
        loaders = [trainer.train_dataloader]
    for loader in loaders:
        sampler = getattr(loader, "batch_sampler", None)
        if isinstance(sampler, PartitionBatchSampler):
            return loader, sampler
    return None


def collate(loader: Any, indices: Sequence[int]) -> Any:
    """The batch ``loader`` would yield for these dataset indices."""
    dataset = loader.dataset
    collate_fn = getattr(loader, "collate_fn", None) or default_collate
    return collate_fn([dataset[int(i)] for i in indices])


@contextmanager
def _muted(module: LightningModule) -> Iterator[None]:
    """Silence ``self.log`` inside a probe call of the user's training_step."""
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log
        del module.log_dict
