"""What PGC can and cannot run, decided as early as possible: in the launching process, before any rank starts.

Under PGC a rank that fell behind skips ``training_step`` (it applies an aggregate the others already published),
so anything that must happen on *every* rank inside ``training_step`` (a collective: ``self.log(sync_dist=True)``,
``self.all_gather``, ``SyncBatchNorm``, a torchmetrics metric that syncs) would be unmatched and hang. Those are
refused: :func:`check_fit` inspects the Trainer, the LightningModule (including the source of ``training_step``)
and any DataLoader passed to ``fit`` before the launcher spawns the ranks (:class:`PreflightLauncher`), and
:class:`CollectiveGuard` refuses at the first call what only shows at run time. The compatibility table in
``docs/guide.md`` lists every case, each backed by a test.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from typing_extensions import override

from lightning_pgc._lightning import Launcher

__all__ = ["CollectiveGuard", "PGCUnsupportedError", "PreflightLauncher", "SingleUseClosure", "check_fit"]

#: What to do instead of a collective in ``training_step``.
INSTEAD = (
    "a rank that falls behind under PGC skips training_step, so a collective there would be unmatched. Log without "
    "it (`sync_dist=False`): log the loss from `on_train_batch_end`, whose `outputs['loss']` is the decoded loss, "
    "identical on every rank (also logged as `pgc/train_loss`); compute values that need every rank in "
    "`validation_step`, `on_train_epoch_end` or a callback, which every rank runs (a collective every step waits "
    "for the slowest rank)"
)

#: Names of collective calls looked for in the source of ``training_step``.
COLLECTIVE_CALLS = frozenset(
    {"all_gather", "all_reduce", "all_gather_object", "barrier", "broadcast", "broadcast_object_list",
     "reduce_scatter", "all_to_all", "gather_all_tensors", "reduce_boolean_decision"}
)


class PGCUnsupportedError(ValueError):
    """A training setup PGC cannot run with identical replicas; the message says what to do instead."""


# ================================================================================================ before launch
class PreflightLauncher(Launcher):
    """Wraps Lightning's launcher so that :func:`check_fit` runs in the launching process before any rank starts.

    Lightning 2.6.6 calls ``strategy.launcher.launch(trainer._fit_impl, model, train_dataloaders, val_dataloaders,
    datamodule, ckpt_path, trainer=trainer)`` from ``trainer.fit`` (``lightning/pytorch/trainer/call.py``), with the
    model, callbacks and precision already resolved: the earliest point where all of them can be inspected.
    """

    def __init__(self, launcher: Launcher, check: Callable[[Trainer, tuple[Any, ...]], None]) -> None:
        self.launcher = launcher
        self.check = check

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return self.launcher.is_interactive_compatible

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[Trainer] = None, **kwargs: Any) -> Any:
        if trainer is not None:
            self.check(trainer, args)
        return self.launcher.launch(function, *args, trainer=trainer, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        self.launcher.kill(signum)

    def __getattr__(self, name: str) -> Any:  # e.g. ``procs`` of the subprocess launcher
        return getattr(self.__dict__["launcher"], name)


def check_fit(trainer: Trainer, module: Any, train_dataloaders: Any = None, layer_sync: bool = False) -> None:
    """Refuse, with what to do instead, every setup of ``trainer.fit(module, train_dataloaders)`` PGC cannot run.

    Raises:
        PGCUnsupportedError: the first unsupported feature found.
    """
    check_trainer(trainer, layer_sync)
    if isinstance(module, LightningModule):
        check_module(module)
    for loader in _loaders(train_dataloaders):
        check_train_loader(loader)


def check_trainer(trainer: Any, layer_sync: bool = False) -> None:
    """Accumulation, loss-scaled precision and ``sync_batchnorm``: known from the Trainer's arguments."""
    if trainer.accumulate_grad_batches != 1:
        raise PGCUnsupportedError(
            "PGCStrategy does not support `accumulate_grad_batches`: raise the DataLoader's batch_size instead (each "
            "rank evaluates one mini-batch per partition per step)"
        )
    if any(isinstance(cb, GradientAccumulationScheduler) for cb in getattr(trainer, "callbacks", ())):
        raise PGCUnsupportedError(
            "PGCStrategy does not support `GradientAccumulationScheduler` (it changes `accumulate_grad_batches` "
            "mid-fit, so the partition sampler's step would drift from the optimizer step): remove it and raise the "
            "DataLoader's batch_size instead"
        )
    precision = str(trainer.precision)
    if precision.startswith("16"):
        raise PGCUnsupportedError(
            f"PGCStrategy does not support precision={precision!r} (its gradient scaler would have to agree across "
            "stale gradients of different steps); use '32-true' or 'bf16-mixed'"
        )
    if layer_sync:
        raise PGCUnsupportedError(
            "PGCStrategy does not support `sync_batchnorm=True`: SyncBatchNorm all-reduces in every forward pass, "
            "and a rank that fell behind skips its forward pass. Use plain BatchNorm: PGC averages the running "
            "statistics of the received ranks every step, so they stay identical on every rank"
        )


def check_module(module: LightningModule) -> None:
    """Manual optimization, SyncBatchNorm, syncing torchmetrics and collectives in ``training_step``'s source."""
    if not module.automatic_optimization:
        raise PGCUnsupportedError(
            "PGCStrategy needs automatic optimization (`self.automatic_optimization = True`): it decodes the "
            "gradient inside the optimizer step. Manual optimization, and multiple optimizers (which need it in "
            "Lightning 2), are not supported; use one optimizer with several param groups instead"
        )
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.SyncBatchNorm):
            raise PGCUnsupportedError(
                f"PGCStrategy does not support SyncBatchNorm ({name or 'the module'}): it all-reduces in every "
                "forward pass, and a rank that fell behind skips its forward pass. Use plain BatchNorm: PGC averages "
                "the running statistics of the received ranks every step"
            )
        if getattr(sub, "dist_sync_on_step", False) and _is_metric(sub):
            raise PGCUnsupportedError(
                f"PGCStrategy does not support torchmetrics with `dist_sync_on_step=True` ({name}): it syncs on "
                f"every update, and {INSTEAD}"
            )
    found = scan_training_step(type(module))
    if found:
        raise PGCUnsupportedError(f"PGCStrategy: {found} in training_step: {INSTEAD}")


def check_train_loader(loader: Any) -> None:
    """The training DataLoader: PGC draws each partition's mini-batches itself, from a map-style dataset."""
    if not isinstance(loader, DataLoader):
        return
    if isinstance(loader.dataset, IterableDataset):
        raise PGCUnsupportedError(
            "PGCStrategy needs a map-style training dataset (with __len__ and __getitem__): it splits the data "
            "into partitions and draws each partition's mini-batches itself. Wrap the IterableDataset's samples in "
            "a map-style dataset"
        )
    if loader.batch_size is None:
        raise PGCUnsupportedError(
            "PGCStrategy assigns mini-batches to partitions itself: give the training DataLoader a `batch_size` "
            "instead of a custom `batch_sampler`"
        )
    sampler = loader.sampler
    if not isinstance(sampler, (RandomSampler, SequentialSampler)) and not _lightning_sampler(sampler):
        raise PGCUnsupportedError(
            f"PGCStrategy replaces the training sampler with its partition sampler; a custom sampler "
            f"({type(sampler).__name__}) would be silently ignored. Remove it (shuffle=True or False both work); "
            "to weight samples, weight the loss instead"
        )


def _lightning_sampler(sampler: Any) -> bool:
    """Lightning's injected ``DistributedSampler`` over a default sampler (not its wrapper of a custom one)."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import DistributedSampler

    return isinstance(sampler, DistributedSampler) and not isinstance(sampler, DistributedSamplerWrapper)


def _loaders(obj: Any) -> Iterator[Any]:
    if isinstance(obj, DataLoader):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _loaders(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _loaders(value)


def _is_metric(module: torch.nn.Module) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, Metric)


def scan_training_step(cls: type) -> Optional[str]:
    """The first collective found in the source of ``cls.training_step`` or of the ``self.`` methods it calls
    (``sync_dist=`` not ``False``, or a call named in :data:`COLLECTIVE_CALLS`), as a phrase; ``None`` if none."""
    seen: set[str] = set()
    todo = ["training_step"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        tree = _method_ast(cls, name)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            for kw in node.keywords:
                if kw.arg == "sync_dist" and not (isinstance(kw.value, ast.Constant) and not kw.value.value):
                    return f"`sync_dist=...` (line {node.lineno} of {name})"
            func = node.func
            if isinstance(func, ast.Attribute):
                if func.attr in COLLECTIVE_CALLS:
                    return f"the collective `{func.attr}` (line {node.lineno} of {name})"
                if isinstance(func.value, ast.Name) and func.value.id == "self":
                    todo.append(func.attr)
    return None


def _method_ast(cls: type, name: str) -> Optional[ast.AST]:
    """The parsed source of a method defined by the user (not by Lightning), or ``None``."""
    for klass in cls.__mro__:
        if name in vars(klass):
            if klass.__module__.startswith(("lightning.", "pytorch_lightning.", "torch.")):
                return None
            func = vars(klass)[name]
            try:
                source = textwrap.dedent(inspect.getsource(func))
                return ast.parse(source)
            except (OSError, TypeError, SyntaxError):
                return None
    return None


# ================================================================================================== at run time
class CollectiveGuard:
    """Refuses, while ``training_step`` runs, what :func:`scan_training_step` cannot see statically: a collective
    through the strategy (``reduce``, ``all_gather``, ``broadcast``, ``barrier``) or ``self.log`` of a value that
    syncs (``sync_dist=True``, a torchmetrics metric with ``sync_on_compute``/``dist_sync_on_step``)."""

    def __init__(self) -> None:
        self.active = False

    def refuse(self, what: str) -> None:
        """Raise if inside ``training_step``."""
        if self.active:
            raise PGCUnsupportedError(f"PGCStrategy: {what} inside training_step: {INSTEAD}")

    @contextmanager
    def __call__(self, module: Any) -> Iterator[None]:
        """Guard one call of the user's ``training_step``."""
        if self.active or not isinstance(module, LightningModule):
            yield
            return
        log, log_dict = module.log, module.log_dict
        own = {name: vars(module)[name] for name in ("log", "log_dict") if name in vars(module)}  # e.g. muted

        def guarded_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            self._check_logged(name, value, kwargs)
            log(name, value, *args, **kwargs)

        def guarded_log_dict(dictionary: Any, *args: Any, **kwargs: Any) -> None:
            for name, value in dict(dictionary).items():
                self._check_logged(name, value, kwargs)
            log_dict(dictionary, *args, **kwargs)

        module.log, module.log_dict = guarded_log, guarded_log_dict  # type: ignore[method-assign]
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for name in ("log", "log_dict"):
                if name in own:
                    setattr(module, name, own[name])
                else:
                    delattr(module, name)

    def _check_logged(self, name: str, value: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("sync_dist"):
            self.refuse(f"`self.log({name!r}, ..., sync_dist=True)`")
        if _is_metric(value) and (getattr(value, "sync_on_compute", False) or value.dist_sync_on_step):
            self.refuse(
                f"`self.log({name!r}, <torchmetrics {type(value).__name__}>)` of a metric that syncs across ranks "
                "(construct it with `sync_on_compute=False` to log this rank's value)"
            )


class SingleUseClosure:
    """The optimizer closure of one PGC step: it runs the exchange once and refuses a second call.

    LBFGS, SAM and other optimizers that evaluate the closure several times per step would re-enter the exchange
    for a version that is already closed (and wait for an aggregate that never comes).
    """

    def __init__(self, exchange: Callable[[], Any]) -> None:
        self.exchange = exchange
        self.calls = 0

    def __call__(self) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise PGCUnsupportedError(
                "PGCStrategy: the optimizer called the closure a second time in one step (LBFGS, SAM and other "
                "line-search or two-pass optimizers do). PGC exchanges one gradient per step: use an optimizer that "
                "evaluates the closure once (SGD, Adam, AdamW, ...)"
            )
        return self.exchange()

