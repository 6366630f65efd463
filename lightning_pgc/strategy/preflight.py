"""What PGC can and cannot run, decided as early as possible: in the launching process, before any rank starts.

Under PGC a rank that fell behind skips ``training_step`` (it applies an aggregate the others already published),
so anything that must happen on *every* rank inside ``training_step`` (a collective: ``self.log(sync_dist=True)``,
``self.all_gather``, ``SyncBatchNorm``, a torchmetrics metric that syncs) would be unmatched and hang. Those are
refused: :func:`check_fit` inspects the Trainer, the LightningModule (including the source of ``training_step``)
and any DataLoader passed to ``fit`` before the launcher spawns the ranks (the launchers' ``preflight``), and
:class:`CollectiveGuard` refuses at the first call what only shows at run time. The compatibility table in
``docs/guide.md`` lists every case, each backed by a test.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler, LearningRateFinder
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler
from torchmetrics import Metric  # (a dependency of Lightning's)


__all__ = ["CollectiveGuard", "PGCUnsupportedError", "SingleUseClosure", "check_fit"]

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
    {
        "all_gather",
        "all_reduce",
        "all_gather_object",
        "barrier",
        "broadcast",
        "broadcast_object_list",
        "reduce_scatter",
        "all_to_all",
        "gather_all_tensors",
        "reduce_boolean_decision",
    }
)


class PGCUnsupportedError(ValueError):
    """A training setup PGC cannot run with identical replicas; the message says what to do instead."""


# ================================================================================================ before launch
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
    if any(isinstance(cb, LearningRateFinder) for cb in getattr(trainer, "callbacks", ())):
        # (Lightning itself refuses the batch-size finder under every distributed strategy, ddp included)
        raise PGCUnsupportedError(
            "PGCStrategy does not run Lightning's learning-rate finder (`Tuner.lr_find`, `LearningRateFinder`): its "
            "trial steps run before the PGC runtime starts, so the ranks would not exchange gradients. Run the tuner "
            "on the same module under `Trainer(strategy='ddp')` or on one device, then pass the learning rate it "
            "found to a new PGC `Trainer` (stale schemes may need a lower one: docs/guide.md)"
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
    if found.certain:
        raise PGCUnsupportedError(f"PGCStrategy: {found.certain[0]} in training_step: {INSTEAD}")
    if found.possible:
        rank_zero_warn(
            f"PGCStrategy: training_step may call a collective ({'; '.join(found.possible)}). If such a call "
            f"runs, it is refused at that moment on every rank: {INSTEAD}"
        )


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
    return isinstance(module, Metric)


@dataclass
class ScanResult:
    """What :func:`scan_training_step` found: collectives that run at every call (``certain``: refused before
    launch) and collectives that run only under a condition or with a computed ``sync_dist`` (``possible``: a
    warning; :class:`CollectiveGuard` refuses them at their first actual call)."""

    certain: list[str] = field(default_factory=list)
    possible: list[str] = field(default_factory=list)


def scan_training_step(cls: type) -> ScanResult:
    """The collectives in the source of ``cls.training_step`` and of the ``self.`` methods it calls, each as a
    phrase: ``self.log(..., sync_dist=...)`` with anything but a literal ``False``, or a call named in
    :data:`COLLECTIVE_CALLS`.

    A collective is *certain* when every call of ``training_step`` reaches it: it sits in a statement at the top
    level of the method (or of a ``with`` block there), before any branch that may return or raise, outside the
    branches of a conditional expression, the right-hand operands of ``and``/``or``, lambdas and comprehensions,
    and, for ``sync_dist``, with the literal value ``True``. A helper called from such a position is scanned the
    same way; one called from anywhere else counts as possible throughout.
    """
    result = ScanResult()
    seen: set[tuple[str, bool]] = set()
    todo: list[tuple[str, bool]] = [("training_step", True)]
    while todo:
        name, certain = todo.pop()
        if (name, certain) in seen or (name, True) in seen:
            continue
        seen.add((name, certain))
        tree = _method_ast(cls, name)
        if tree is None:
            continue
        func = tree.body[0] if isinstance(tree, ast.Module) and tree.body else None
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node, reached in _calls(func.body, certain):
            for kw in node.keywords:
                if kw.arg == "sync_dist" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    literal = isinstance(kw.value, ast.Constant) and kw.value.value is True
                    where = result.certain if reached and literal else result.possible
                    where.append(f"`sync_dist={ast.unparse(kw.value)}` (line {node.lineno} of {name})")
            callee = node.func
            if isinstance(callee, ast.Attribute):
                if callee.attr in COLLECTIVE_CALLS:
                    where = result.certain if reached else result.possible
                    where.append(f"the collective `{callee.attr}` (line {node.lineno} of {name})")
                elif isinstance(callee.value, ast.Name) and callee.value.id == "self":
                    todo.append((callee.attr, reached))
    return result


def _calls(body: list[ast.stmt], certain: bool) -> Iterator[tuple[ast.Call, bool]]:
    """Every call in ``body`` with whether each run of ``body`` reaches it (given that ``body`` runs if
    ``certain``)."""
    for stmt in body:
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                yield from _expr_calls(item.context_expr, certain)
            yield from _calls(stmt.body, certain)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # defined here, runs only if called
        elif _is_compound(stmt):
            for child in ast.iter_child_nodes(stmt):
                if isinstance(child, ast.expr):
                    yield from _expr_calls(child, False)
                elif isinstance(child, ast.stmt):
                    yield from _calls([child], False)
                else:  # except handlers, match cases
                    for grand in ast.iter_child_nodes(child):
                        if isinstance(grand, ast.stmt):
                            yield from _calls([grand], False)
                        elif isinstance(grand, ast.expr):
                            yield from _expr_calls(grand, False)
            if any(isinstance(n, (ast.Return, ast.Raise, ast.Break, ast.Continue)) for n in ast.walk(stmt)):
                certain = False  # what follows runs only if that branch was not taken
        else:
            for child in ast.iter_child_nodes(stmt):
                if isinstance(child, ast.expr):
                    yield from _expr_calls(child, certain)
            if isinstance(stmt, (ast.Return, ast.Raise)):
                certain = False


def _is_compound(stmt: ast.stmt) -> bool:
    return isinstance(stmt, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.Match)) or (
        type(stmt).__name__ == "TryStar"
    )


def _expr_calls(expr: ast.expr, certain: bool) -> Iterator[tuple[ast.Call, bool]]:
    """The calls in ``expr``; those in branches that may not be evaluated count as not reached."""
    if isinstance(expr, ast.IfExp):
        yield from _expr_calls(expr.test, certain)
        yield from _expr_calls(expr.body, False)
        yield from _expr_calls(expr.orelse, False)
        return
    if isinstance(expr, ast.BoolOp):
        yield from _expr_calls(expr.values[0], certain)
        for value in expr.values[1:]:
            yield from _expr_calls(value, False)
        return
    if isinstance(expr, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        for node in ast.walk(expr):
            if isinstance(node, ast.Call):
                yield node, False
        return
    if isinstance(expr, ast.Call):
        yield expr, certain
    for child in ast.iter_child_nodes(expr):
        if isinstance(child, ast.expr):
            yield from _expr_calls(child, certain)
        elif isinstance(child, ast.keyword):
            yield from _expr_calls(child.value, certain)


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
