"""PGCStrategy: the Lightning glue of pipelined gradient coding. The math is in :mod:`lightning_pgc.codes`, the
messaging in :mod:`lightning_pgc.runtime`; this module only connects them to Lightning's training loop. Its
parts, one per concept, are the other modules of :mod:`lightning_pgc.strategy`: ``pipeline_checkpoint``
(pipeline files), ``live_routing`` (collectives among the live ranks), ``rejoin`` (state transfer),
``leadership`` (the rank-zero seat), ``arms`` (``scheme="auto"``), ``gradients`` (the payload layout),
``bounded_choice`` (bounded choice), ``loaders`` (the training DataLoader re-created around the partition batches of
:mod:`lightning_pgc.sampling`), ``preflight`` (refused setups) and ``options`` (the constructor's option groups).

Per optimizer step ``t`` (= the model version, Invariant 1) every rank:

1. skips forward/backward if the aggregate of ``t`` is already published (it fell behind: Invariant 3);
2. otherwise runs the training step on the partitions ``scheme.evaluations(rank, t)`` (one mini-batch chunk
   per partition), keeps what backward left in ``param.grad`` as each partition's cache entry (no copy), encodes
   the valid entries straight into a code on the model's device, checks the code is finite and announces it to the
   runtime's leader;
3. points ``param.grad`` at the aggregate (one all-reduce of every rank's share of the decode, run by the
   runtime's comm thread) and lets its own optimizer step, so every replica
   applies the identical sequence of aggregates (Invariant 2).

A rank that fell more than ``liveness.max_lag`` versions behind gets no aggregates (bounded memory); when it is back
it receives the training state at the open version ``u`` from a donor (state transfer), runs its remaining steps
before ``u`` without computing or applying anything, loads the state at ``u`` and goes on with an empty cache.

A checkpoint saved during fit carries every rank's stale cache in ``<checkpoint>.pgc/rank{k}.pt``
(:mod:`~lightning_pgc.strategy.pipeline_checkpoint`); a fit resuming from it reloads the cache and continues the
pipeline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sized
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Literal, Mapping, NamedTuple, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

import lightning.pytorch as pl
from lightning_pgc._lightning import (
    closure_loss,
    default_pg_timeout,
    has_layer_sync,
    launches_in_rank_zero,
    leave_training_loaders,
    mark_launching_rank,
    replace_sigterm_broadcast,
    replace_sigterm_notifier,
    set_closure_loss,
    surviving_launcher,
    sync_module_states,
    wrap_launcher,
)
from lightning_pgc.callbacks import PGCDiagnostics
from lightning_pgc.strategy.pipeline_checkpoint import PipelineCheckpoints
from lightning_pgc.strategy.bounded_choice import ChoiceBook
from lightning_pgc.strategy.gradients import Gradients
from lightning_pgc.codes import AutoScheme, BoundedScheme, Scheme, StaleCache, make_scheme
from lightning_pgc.strategy.preflight import (
    CollectiveGuard,
    PGCUnsupportedError,
    SingleUseClosure,
    check_fit,
    check_train_loader,
    check_trainer,
)
from lightning_pgc.strategy.loaders import partition_loader
from lightning_pgc.sampling import PartitionBatchSampler, select_partition, split_batch
from lightning_pgc.strategy.leadership import Leadership
from lightning_pgc.strategy.live_routing import ALONE, LiveRouting
from lightning_pgc.strategy.options import (
    AutoOptions,
    CodingOptions,
    CoordinatorOptions,
    DiagnosticsOptions,
    LivenessOptions,
    as_group,
    check_options,
)
from lightning_pgc.strategy.arms import ArmLog
from lightning_pgc.decisions.auto import AutoCandidate
from lightning_pgc.decisions.bounded import BoundedLeader
from lightning_pgc.decisions.leader import Leader
from lightning_pgc.runtime.control import host_store, open_store, run_prefix
from lightning_pgc.runtime.group import DATA_BACKENDS, DataBackend
from lightning_pgc.runtime.plane import CollectiveRuntime, PGCDetached, PGCInterrupted
from lightning_pgc.staleness import StalenessCorrection
from lightning_pgc.strategy.rejoin import StateTransfer

log = logging.getLogger("lightning_pgc.strategy")  # the name users filter on


class Registered(NamedTuple):
    """A strategy name in Lightning's ``StrategyRegistry``: its description and the ``PGCStrategy`` keyword arguments
    it stands for (option groups as dicts of their fields)."""

    description: str
    kwargs: dict[str, Any]


#: Registered names -> what they stand for. A name without ``stragglers`` keeps the constructor's default. ``pgc`` is
#: the pipelined configuration the map supports (tests/test_readme.py ties it to docs/results/which_strategy.json);
#: ``pgc_cr`` is the uncorrected scheme.
REGISTERED: dict[str, Registered] = {
    "pgc": Registered(
        "Pipelined gradient coding, cyclic repetition (s=1), with the look-ahead staleness correction",
        {"scheme": "pgc_cr", "stragglers": 1, "coding": {"staleness_correction": "lookahead"}},
    ),
    "pgc_cr": Registered(
        "Pipelined gradient coding with cyclic repetition (s=1), uncorrected",
        {"scheme": "pgc_cr", "stragglers": 1},
    ),
    "pgc_fr": Registered(
        "Pipelined gradient coding with fractional repetition (s=1)", {"scheme": "pgc_fr", "stragglers": 1}
    ),
    "gc_cr": Registered(
        "Gradient coding (Tandon et al.) with cyclic repetition (s=1)", {"scheme": "gc_cr", "stragglers": 1}
    ),
    "gc_fr": Registered("Gradient coding with fractional repetition (s=1)", {"scheme": "gc_fr", "stragglers": 1}),
    "ignore_stragglers": Registered(
        "Average the fastest n-1 gradients, ignore the slowest rank", {"scheme": "ignore", "stragglers": 1}
    ),
    "dgd": Registered(
        "Distributed gradient descent through the PGC runtime (waits for all ranks)", {"scheme": "dgd", "stragglers": 0}
    ),
    "pgc_auto": Registered(
        "Starts as dgd and switches to ignoring the slowest ranks (and back) from the step times it measures",
        {"scheme": "auto"},
    ),
    "bounded_staleness": Registered(
        "Bounded-staleness table: replication 2, newest entry per partition younger than c=2",
        {"scheme": "bounded", "coordinator": {"replication": 2, "staleness": 2}},
    ),
}


@dataclass
class StepInfo:
    """What this rank did for one version (read by :class:`~lightning_pgc.PGCDiagnostics`)."""

    version: int
    loss: float
    skipped: bool  # applied a published aggregate without computing
    evaluated: tuple[int, ...]  # partitions evaluated fresh at this version
    worker_wait_s: float  # from sending the code to holding the aggregate
    aggregate: Tensor  # flat gradient part of the aggregate (a view of the runtime buffer: valid until the next step)


class PGCStrategy(DDPStrategy):
    """Data-parallel training that never waits for the ``stragglers`` slowest ranks.

    Args:
        scheme: one of ``dgd``, ``ignore``, ``gc_fr``, ``gc_cr``, ``pgc_fr``, ``pgc_cr``, ``pgc_cr_naive``,
            ``bounded`` (bounded staleness, ``docs/results/bounded_staleness.md``: its options are ``coordinator``), or
            ``auto`` (``pgc_auto``, ``docs/guide.md``: starts as ``dgd`` and switches to ``ignore`` with ``s`` up to
            ``auto.max_stragglers`` and back, from the step times the leader measures; its options are ``auto``).
        stragglers: ``s``, how many of the slowest ranks each step may ignore (``c = s + 1`` copies per partition).
            Not used by ``bounded`` (``coordinator.replication`` sets its copies) nor ``auto``.
        seed: seed of the partition split and of each partition's mini-batch stream.
        nonfinite: what to do with a gradient, loss or buffer (BatchNorm statistics) that contains NaN or inf:
            ``"skip"`` drops the rank's code (the rank is a straggler for that step, a bad gradient's cache entry is
            evicted, bad buffers are replaced by the aggregate's, ``pgc/rejected/rank{k}`` counts it; once more
            ranks than the scheme tolerates drop theirs at one step, every rank fails with ``DivergedError``:
            lower the learning rate); ``"raise"`` stops training with an error on that rank. Non-zero
            ``pgc/rejected/rank{k}`` means lower the learning rate or clip gradients.
        data_backend: the backend of PGC's data group, the one all-reduce per step. ``None`` (default): NCCL when the
            model is on a CUDA device, gloo otherwise. ``"gloo"`` on CUDA keeps the codes, aggregates and
            ``param.grad`` on the GPU and stages each all-reduce through host memory: the way for several ranks to
            share one GPU, which NCCL refuses (pass ``process_group_backend="gloo"`` too). ``"nccl"`` needs CUDA.
        coding: how each rank's code is built and decoded: the pipelined schemes' warm-up, the staleness correction
            and the conditioning limit of Tandon decodes (:class:`~lightning_pgc.CodingOptions`).
        coordinator: ``scheme="bounded"`` only: the bounded-staleness coordinator's replication, window, freshness,
            widening and partition choice (:class:`~lightning_pgc.CoordinatorOptions`).
        auto: ``scheme="auto"`` only: the switching rule's largest ``s``, margin, threshold and horizon
            (:class:`~lightning_pgc.AutoOptions`).
        liveness: heartbeats, the timeout for missing ranks, how far a rank may lag, and leader failover
            (:class:`~lightning_pgc.LivenessOptions`).
        diagnostics: the ``pgc/...`` metrics callback the strategy attaches
            (:class:`~lightning_pgc.DiagnosticsOptions`).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for ``ddp``.
        process_group_backend: the backend of Lightning's default process group (as for ``ddp``); it does not
            carry PGC's gradients (``data_backend`` does).
        process_group_timeout: timeout of Lightning's default process group (as ``DDPStrategy(timeout=...)``).
        start_method: how Lightning launches the ranks, as for ``ddp``; with any of them a dead rank does not make
            the launcher kill the others (up to ``s`` dead workers are survived, see docs/guide.md).

    Each group takes its dataclass or a dict of its fields: ``PGCStrategy(scheme="bounded", coordinator={"staleness":
    3})``, and in a LightningCLI recipe ``coordinator: {replication: 2, staleness: 3}`` under ``init_args``.
    """

    strategy_name = "pgc"

    def __init__(
        self,
        scheme: str = "pgc_cr",
        stragglers: int = 1,
        seed: int = 0,
        nonfinite: Literal["skip", "raise"] = "skip",
        data_backend: Optional[DataBackend] = None,
        coding: Union[CodingOptions, dict[str, Any]] = CodingOptions(),
        coordinator: Union[CoordinatorOptions, dict[str, Any]] = CoordinatorOptions(),
        auto: Union[AutoOptions, dict[str, Any]] = AutoOptions(),
        liveness: Union[LivenessOptions, dict[str, Any]] = LivenessOptions(),
        diagnostics: Union[DiagnosticsOptions, dict[str, Any]] = DiagnosticsOptions(),
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        process_group_timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.coding = as_group(CodingOptions, coding)
        self.coordinator = as_group(CoordinatorOptions, coordinator)
        self.auto = as_group(AutoOptions, auto)
        self.liveness = as_group(LivenessOptions, liveness)
        self.diagnostics = as_group(DiagnosticsOptions, diagnostics)
        check_options(
            scheme=scheme,
            stragglers=stragglers,
            seed=seed,
            nonfinite=nonfinite,
            coding=self.coding,
            coordinator=self.coordinator,
            auto=self.auto,
        )
        if data_backend is not None and not isinstance(data_backend, str):
            raise TypeError(f"PGCStrategy(data_backend=...) must be str or None, got {data_backend!r}")
        if data_backend is not None and data_backend not in DATA_BACKENDS:
            raise ValueError(f"data_backend must be one of {', '.join(DATA_BACKENDS)} or None, got {data_backend!r}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=process_group_timeout,
            start_method=start_method,
        )
        self.scheme_name = scheme
        self.stragglers = stragglers
        self.seed = seed
        self.nonfinite = nonfinite
        self.data_backend = data_backend
        self._staleness = StalenessCorrection("none", 0.0)  # rebuilt for each fit (_start_runtime)
        self._arms = ArmLog(self)  # scheme="auto": the arm of every version this rank applied, and the switches
        self.scheme: Optional[Scheme] = None
        self.runtime: Optional[CollectiveRuntime] = None
        self.cache: Optional[StaleCache] = None
        self.last_step: Optional[StepInfo] = None
        self.skipped_steps = 0
        self.buffer_stats: dict[str, int] = {}
        self._rank_stats: list[dict[str, float]] = []
        self.gradients = Gradients([], [], torch.device("cpu"))  # the payload layout (per fit)
        self._held: Optional[Tensor] = None  # the aggregate param.grad currently views
        self._warm_start: Optional[int] = None
        self._version = 0
        self._step_began = 0.0
        self._evaluations: tuple[int, ...] = ()
        self._sampled: tuple[int, ...] = ()  # partitions whose mini-batches the step's batch holds (in that order)
        self.collective_guard = CollectiveGuard()  # active while the user's training_step runs (also in probes)
        self._partition_batch_size: Optional[int] = None  # samples per partition evaluation (the loader's batch_size)
        self._checkpoints = PipelineCheckpoints(self)  # per-rank pipeline files next to Lightning's checkpoints
        self._live = LiveRouting(self)  # collectives, metric syncs and SIGTERM among the live ranks during fit
        self._transfer = StateTransfer(self)  # rejoin by state transfer after falling max_lag versions behind
        self._choices = ChoiceBook()  # bounded: what the partition choice remembers between steps
        self._leadership = Leadership(self)  # which rank does Lightning's rank-zero work (rank 0, or its successor)

    # ------------------------------------------------------------------------------------------ configuration
    def _make_scheme(self, world_size: int) -> Scheme:
        if self.scheme_name == "auto":
            return AutoScheme(world_size, self.auto.max_stragglers, seed=self.seed)
        if self.scheme_name == "bounded":
            bounded = self.coordinator
            return BoundedScheme(
                world_size,
                bounded.replication,
                bounded.staleness,
                fresh=bounded.fresh,
                choice=bounded.choice,
                seed=self.seed,
            )
        return make_scheme(
            self.scheme_name,
            world_size,
            self.stragglers,
            warmup=self.coding.warmup,
            seed=self.seed,
            max_condition=self.coding.max_condition,
        )

    @override
    def _configure_launcher(self) -> None:
        # A private DDPStrategy hook (Lightning 2.6.6): validate (n, s) in the launching process, before any rank
        # starts, so a bad configuration fails once instead of in every rank.
        if self.parallel_devices is not None:
            self._make_scheme(self.num_nodes * len(self.parallel_devices))
        super()._configure_launcher()
        # Lightning's launchers kill every rank when one dies; PGC survives up to s dead ranks.
        failover = self.liveness.failover is not False
        if self._start_method != "popen":  # the launching process is not a rank: the control plane's store lives
            host_store()  # here (under popen rank 0 launches, and the default group's store, which it hosts, serves)
        # Lightning hands each call's model and loaders to the launcher: ``_preflight`` checks them there, before
        # any rank starts.
        wrap_launcher(
            self,
            lambda launcher: surviving_launcher(
                launcher, self._live.reap_grace_s(), failover, preflight=self._preflight
            ),
        )
        mark_launching_rank(self._launcher)
        if self.liveness.failover and launches_in_rank_zero(self):
            raise ValueError(
                "PGCStrategy(liveness={'failover': True}): rank 0 is the launching process under start_method='popen' "
                "(outside SLURM or torchrun), so its death ends the job; use start_method='fork' or "
                "'spawn', or leave liveness.failover unset"
            )

    def _preflight(self, trainer: "pl.Trainer", args: tuple[Any, ...]) -> None:
        """Refuse, in the launching process, every setup PGC cannot run (see :mod:`~lightning_pgc.strategy.preflight`)."""
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = args[0] if args else None
        loaders = args[1] if len(args) > 1 else None
        check_fit(trainer, module, loaders, layer_sync=has_layer_sync(self))

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.scheme = self._make_scheme(self.world_size)

    def warm_start_step(self) -> int:
        """The step at which this fit's caches were empty (fit start, or the step a checkpoint resumed at)."""
        if self._warm_start is None:
            self._warm_start = self._module().trainer.global_step
        return self._warm_start

    def _module(self) -> "pl.LightningModule":
        """The LightningModule being trained (the hooks that read it run once Lightning attached it)."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError("PGCStrategy: no LightningModule is attached yet (Lightning attaches it before setup)")
        return module

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self._warm_start = None
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_supported(trainer)
            leave_training_loaders(trainer)  # before `super().setup`: `estimated_stepping_batches` builds them there
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            replace_sigterm_broadcast(trainer, LiveRouting.local_sigterm_check(trainer))
            replace_sigterm_notifier(trainer, LiveRouting.sigterm_notifier(trainer))
        if trainer.state.fn == TrainerFn.FITTING and self.diagnostics.enabled:
            # (Lightning's callback connector sets `Trainer.callbacks`; Trainer does not declare it)
            callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
            if not any(isinstance(cb, PGCDiagnostics) for cb in callbacks):
                callbacks.append(PGCDiagnostics(every_n_steps=self.diagnostics.every_n_steps))

    def _check_supported(self, trainer: "pl.Trainer") -> None:
        """The launch-time checks again in every rank (a launcher that bypasses ``launch``, e.g. a bare script)."""
        check_trainer(trainer, layer_sync=has_layer_sync(self))
        if not trainer.lightning_module.automatic_optimization:
            raise PGCUnsupportedError(
                "PGCStrategy needs automatic optimization (`self.automatic_optimization = True`): it decodes the "
                "gradient inside the optimizer step"
            )

    @override
    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper (it would all-reduce every backward); just start from rank 0's weights.
        assert self.model is not None
        sync_module_states(self.model)

    # ------------------------------------------------------------------------------------------------- data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader re-created as under ``ddp`` (its class, every argument), with this rank's
        partition batch sampler (:mod:`~lightning_pgc.strategy.loaders`); other loaders are left to Lightning."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        if isinstance(dataloader.batch_sampler, PartitionBatchSampler):
            return dataloader
        check_train_loader(dataloader)  # loaders built by hooks in the ranks: refused on every rank alike
        batch_size = self._partition_batch_size = dataloader.batch_size
        assert batch_size is not None  # (check_train_loader refuses a loader without one)
        dataset, scheme = dataloader.dataset, self.scheme
        if not isinstance(dataset, Sized):
            raise TypeError(f"PGCStrategy splits the training dataset by its length: {type(dataset).__name__} has none")
        if scheme is None:
            raise RuntimeError("PGCStrategy: the scheme is built in setup_environment, before any training loader")
        sampler = PartitionBatchSampler(
            len(dataset),
            scheme,
            rank=self.global_rank,
            batch_size=batch_size,
            seed=self.seed,
            base_step=lambda: trainer.global_step,
            warmup_step=self.warm_start_step,
        )
        return partition_loader(dataloader, sampler)

    # ---------------------------------------------------------------------------------------------- runtime
    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self._module().trainer
        if trainer.sanity_checking and self.runtime is None:
            # Fit's sanity check: the runtime runs from here on, so that its collectives (validation `sync_dist`,
            # metric syncs) go among the live ranks and a rank that dies now does not end the job.
            self._start_runtime(trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.runtime is None:  # (started at the sanity check otherwise)
            self._start_runtime(self._module().trainer)

    def _start_runtime(self, trainer: "pl.Trainer") -> None:
        """Build and start the runtime for this fit (at its sanity check, or at the start of training)."""
        # Every parameter, frozen ones included, and the buffers (BatchNorm statistics, averaged over the received
        # ranks so that the replicas stay identical buffers included; DDP broadcasts rank 0's buffers instead).
        gradients = self.gradients = Gradients.of(self._module(), self.root_device)
        scheme = self.scheme
        assert scheme is not None
        self.cache = StaleCache(scheme.partitions(self.global_rank), max_age=scheme.cache_max_age)
        self._version = trainer.global_step
        resume_from = self._checkpoints.resume_from  # (scheme="auto" continues with the saved arm and window)
        resumed = self._checkpoints.resumed(trainer.global_step)  # this rank's stale cache from the checkpoint
        warm_start = trainer.global_step if resumed is None else resumed.warm_start
        if self._warm_start is None:
            self._warm_start = warm_start
        if self._warm_start != warm_start:
            raise RuntimeError(
                f"PGC: training starts with the pipeline warmed up at step {warm_start}, data was laid "
                f"out for step {self._warm_start}"
            )
        message_bytes = gradients.nbytes
        make_leader: Optional[Callable[..., Leader]] = None
        window = scheme.c
        if isinstance(scheme, BoundedScheme):
            window = self.coordinator.max_staleness or 2 * scheme.window
            make_leader = partial(BoundedLeader, widen_after=self.coordinator.widen_after, max_window=window)
        if isinstance(scheme, AutoScheme):
            make_leader = self._arms.leader_factory(None if resume_from is None else resume_from[1])
        liveness = self.liveness
        max_lag = liveness.max_lag or int(min(1024, max(max(scheme.c, window) + 1, (512 << 20) // message_bytes)))
        self._held = None
        if resumed is not None:
            self._checkpoints.fill(resumed)
        store = open_store(self._timeout or default_pg_timeout)
        self.runtime = CollectiveRuntime(
            scheme,
            store,
            rank=self.global_rank,
            world_size=self.world_size,
            numel=gradients.numel,
            coded_numel=gradients.grad_numel + 1,
            agg_numel=gradients.numel,
            down_dtype=gradients.dtype,
            start_version=trainer.global_step,
            timeout=float(liveness.timeout),
            max_lag=max_lag,
            make_leader=make_leader,
            heartbeat_interval=float(liveness.heartbeat_interval),
            heartbeat_misses=int(liveness.heartbeat_misses),
            device=self.root_device,
            prefix=run_prefix(self.global_rank),
            keep_versions=window if isinstance(scheme, BoundedScheme) else None,
            failover=self._leadership.enabled(),
            data_backend=self.data_backend,
        )
        self.runtime.start()
        self._live.route_metric_syncs()
        self._leadership.pin_loggers(trainer)
        self.skipped_steps = 0
        self._rank_stats = []
        self._transfer.pending = None
        self._choices.reset()
        coding = self.coding
        dc_lambda = {} if coding.dc_lambda is None else {"dc_lambda": float(coding.dc_lambda)}  # (None: its default)
        self._staleness = StalenessCorrection.for_fit(
            coding.staleness_correction, scheme, trainer.optimizers, lookahead=coding.lookahead_steps, **dc_lambda
        )

    @override
    def on_train_end(self) -> None:
        self._stop_runtime()
        self._transfer.finish()
        super().on_train_end()

    def _stop_runtime(self) -> None:
        self._live.restore_metric_syncs()
        if self.runtime is not None:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            leave = trainer is not None and trainer.received_sigterm
            if trainer is not None and leave:
                log.warning(
                    "PGC rank %d: SIGTERM: leaving at step %d (the others go on while enough ranks are left)",
                    self.global_rank,
                    trainer.global_step,
                )
            self.runtime.stop(donate=self._transfer.state_tree, leave=leave)
            self._leadership.follow()  # the leader may have died while this rank finished
            if trainer is not None:
                self._leadership.release_loggers(trainer)
            self.buffer_stats = self.runtime.buffer_stats()
            self._rank_stats = self.runtime.rank_stats()
            if self.cache is not None:
                self.buffer_stats["cache_bytes"] = self.cache.nbytes
            self.runtime = None
        self.cache = None
        self.gradients.clear()
        self._held = None

    @override
    def teardown(self) -> None:
        self._stop_runtime()
        self._checkpoints.resume_from = None
        super().teardown()

    def rank_stats(self) -> list[dict[str, float]]:
        """Who straggles: one dict per rank with ``rank``, ``admitted`` (codes used), ``late`` (codes that arrived
        after their version closed), ``skipped`` (versions applied without computing) and ``mean_lag_s`` (mean
        seconds after each version's first code).

        During fit the table is live on rank 0 (the leader) and empty elsewhere; after fit every rank has the
        final table. Also logged as ``pgc/rank{k}/...`` by :class:`~lightning_pgc.PGCDiagnostics`.
        """
        if self.runtime is not None:
            return self.runtime.rank_stats()
        return list(self._rank_stats)

    @property
    @override
    def is_global_zero(self) -> bool:
        """Whether this rank does Lightning's rank-zero work (checkpoints, loggers, results): rank 0, or the rank that
        took over when it died or froze (``failover``). A plain read: the seat is followed where it may have moved
        (after each exchange, before every collective, checkpoint write and logger write, and when fit ends), so a
        leader that resumes from a freeze learns there, before it writes anything, whether it was replaced."""
        return self.global_rank == self._leadership.rank

    # ------------------------------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Rank 0 writes Lightning's checkpoint (with a ``pgc`` entry); during fit every rank also writes its stale
        cache to ``<filepath>.pgc/rank{k}.pt``, before the barrier that ``Trainer.save_checkpoint`` ends with.

        Called by ``Trainer.save_checkpoint`` on every rank. Outside fit (the cache is released when training
        ends) only Lightning's checkpoint is written; resuming from it warms the pipeline up again.
        """
        self._leadership.follow()  # who writes it
        state = self._checkpoints.state()
        self._checkpoints.entry(state, checkpoint, filepath)
        self._arms.save(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        self._checkpoints.save(state, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the checkpoint (rank 0) and this rank's pipeline file next to it (every rank; the folder goes
        with the last one). Called on every rank, e.g. by ``ModelCheckpoint`` dropping an old checkpoint."""
        self._leadership.follow()  # who removes it
        super().remove_checkpoint(filepath)
        self._checkpoints.remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load Lightning's checkpoint and remember where it is: a fit resuming from it reloads this rank's stale
        cache in ``on_train_start`` (called on every rank, before ``setup``)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._checkpoints.remember(checkpoint_path, checkpoint)
        return checkpoint

    # ------------------------------------------------------------------------------------------ the step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the user's training step once per evaluated partition; all but the last are back-propagated here."""
        evals = self._evaluations
        if args and len(self._sampled) > len(evals):  # the batch holds every held partition: compute the chosen one
            size = None if self._partition_batch_size is None else self._partition_batch_size * len(self._sampled)
            args = (select_partition(args[0], self._sampled, evals[0], size=size), *args[1:])
        with self.collective_guard(self.lightning_module):
            if len(evals) <= 1 or not args:
                return super().training_step(*args, **kwargs)
            size = None if self._partition_batch_size is None else self._partition_batch_size * len(evals)
            chunks = split_batch(args[0], len(evals), size=size)
            self.gradients.zero_grad()  # Lightning zeroes grads only after training_step
            for partition, chunk in zip(evals[:-1], chunks[:-1]):
                output = super().training_step(chunk, *args[1:], **kwargs)
                loss = _loss_of(output)
                self.backward(loss, None)
                self.gradients.adopt(partition, loss)  # the cache entry is param.grad itself: drop it, no copy
                self.gradients.zero_grad()
            return super().training_step(chunks[-1], *args[1:], **kwargs)

    # Collectives are refused inside training_step (a rank that fell behind skips it). During fit (the runtime
    # runs) the others go among the live ranks through the leader, so a dead rank does not end the job; a rank
    # that got SIGTERM is leaving and runs them alone (see LiveRouting.target).
    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        self.collective_guard.refuse("a reduce (e.g. `self.log(..., sync_dist=True)`)")
        self._leadership.follow()
        live = self._live.target()
        if live is None or not isinstance(tensor, Tensor) or group is not None:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        return tensor if live is ALONE else live.reduce(tensor, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        self.collective_guard.refuse("`all_gather`")
        self._leadership.follow()
        live = self._live.target()
        if live is None or group is not None:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        if live is ALONE or sync_grads:
            raise PGCUnsupportedError(
                "`all_gather` during fit "
                + (
                    "after SIGTERM (this rank is leaving)"
                    if live is ALONE
                    else "with sync_grads=True (gradients through a gather)"
                )
                + " is not supported by PGCStrategy; gather outside fit, or use a reduce"
            )
        return live.all_gather(tensor)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.collective_guard.refuse("`broadcast`")
        live = self._live.target()
        if live is None:
            return super().broadcast(obj, src)
        return obj if live is ALONE else live.broadcast(obj, self._leadership.source(src))

    @property
    def auto_arm(self) -> AutoCandidate:
        """``scheme="auto"``: the arm of the last version this rank applied (``dgd`` before the first)."""
        return self._arms.arm

    @property
    def auto_switches(self) -> list[tuple[int, AutoCandidate, AutoCandidate]]:
        """``scheme="auto"``: every switch this rank applied in this fit, as ``(first version under the new arm, old
        arm, new arm)``; the same list on every rank."""
        return list(self._arms.switches)

    @property
    def correction(self) -> StalenessCorrection:
        """The staleness correction of the current fit (``"none"`` outside one)."""
        return self._staleness

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.collective_guard.refuse("`barrier`")
        self._leadership.follow()
        live = self._live.target()
        if live is None:
            super().barrier(*args, **kwargs)
        elif live is not ALONE:
            live.barrier()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        if self.runtime is None:  # e.g. an optimizer step outside fit's training loop
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.scheme is not None
        version = self._version = self._module().trainer.global_step
        self._step_began = time.monotonic()  # this rank's own time for the version runs from here to its code
        start = self.warm_start_step()
        self._evaluations = self.scheme.evaluations(self.global_rank, version, start=start)
        self._sampled = self._evaluations
        if isinstance(self.scheme, BoundedScheme):  # under "oldest": from the table as of the close of version - 1
            self._evaluations, self._sampled = self._choices.choose(self.scheme, self.global_rank, version, start)

        pgc_closure = SingleUseClosure(lambda: self._exchange(version, closure))
        try:
            out = super().optimizer_step(optimizer, pgc_closure, model, **kwargs)
        except PGCInterrupted as exc:  # SIGTERM while waiting on the others: leave as Lightning's SIGTERM does
            raise SIGTERMException() from exc
        self._leadership.follow()
        return out

    def _exchange(self, version: int, closure: Callable[[], Any]) -> Tensor:
        runtime, cache = self.runtime, self.cache
        assert runtime is not None and cache is not None
        skipped = runtime.published(version)
        transfer = self._transfer
        if transfer.pending is None and not skipped and runtime.detached(version):
            if transfer.ahead(version, runtime.frontier()):  # idle up to the open version first, then rejoin
                return transfer.idle_step(version, closure)
            transfer.pending = runtime.rejoin(version, into=transfer.state_tree)
        if transfer.pending is not None and transfer.catch_up(version):
            return transfer.idle_step(version, closure)
        waited = 0.0
        if not skipped:
            try:
                start = self._compute_and_submit(version, closure)
                aggregate = runtime.wait(version, donate=transfer.state_tree)
            except PGCDetached:  # fell too far behind while computing: catch up by state transfer
                if transfer.ahead(version, runtime.frontier()):
                    return transfer.idle_step(version, closure)
                transfer.pending = runtime.rejoin(version, into=transfer.state_tree)
                if transfer.catch_up(version):
                    return transfer.idle_step(version, closure)
                return self._exchange(version, closure)
            waited = time.monotonic() - start
        else:
            self.skipped_steps += 1
            runtime.skipped = self.skipped_steps
            self._staleness.begin_step(version, self.gradients.params)  # the parameters are beta_version here too
            aggregate = runtime.wait(version, donate=transfer.state_tree)
        # ranks that rejoin at this version need the state before this step applies
        runtime.serve_rejoins(version, transfer.state_tree)
        notes = runtime.table(version)
        self._choices.record(version, notes)
        if isinstance(self.scheme, AutoScheme):
            self._arms.applied(version, notes)
        n_grad = self.gradients.grad_numel
        gradient, loss_value, buffers = aggregate[:n_grad], aggregate[n_grad], aggregate[n_grad + 1 :]
        self.gradients.apply(gradient)
        if self._held is not None:
            runtime.release(self._held)  # nothing views the previous aggregate any more
        self._held = aggregate
        self.gradients.load_buffers(buffers)
        loss_t = loss_value.to(torch.float32).clone()
        set_closure_loss(closure, loss_t, skipped)
        self.last_step = StepInfo(
            version, float(loss_t), skipped, () if skipped else self._evaluations, waited, gradient
        )
        return loss_t

    def rejoin_before_collective(self, version: int) -> None:
        """A detached rank that reaches one of Lightning's collectives (a checkpoint, validation) while it idles up to
        the open version: the others ran that collective without it, so it rejoins now (the donor's state carries
        the collective's result, which it replays) instead of waiting for a collective nobody else calls."""
        runtime, transfer = self.runtime, self._transfer
        if runtime is None or transfer.pending is not None:
            return
        if runtime.detached(version) and not runtime.published(version):
            transfer.pending = runtime.rejoin(version, into=transfer.state_tree)

    def _compute_and_submit(self, version: int, closure: Callable[[], Any]) -> float:
        """Run the training step(s), cache the fresh gradients and send this rank's code for ``version``; returns
        when the code left (monotonic seconds)."""
        runtime, cache, scheme = self.runtime, self.cache, self.scheme
        assert runtime is not None and cache is not None and scheme is not None
        gradients = self.gradients
        gradients.begin_step()  # param.grad may view the previous aggregate: never accumulate into it
        if self._held is not None:  # nothing views the previous aggregate now: this version's all-reduce reuses it
            runtime.release(self._held)
            self._held = None
        for p in self._evaluations:  # replaced by this step's gradients: freed before backward allocates those
            cache.discard(p)
        self._staleness.begin_step(version, gradients.params)  # beta_version (not recorded while catching up)
        with self._staleness.shifted(version, gradients.params):  # look-ahead: computed at an extrapolated point
            closure()
        loss = closure_loss(closure)
        if hasattr(closure, "_result") and loss is None:
            raise RuntimeError("PGCStrategy needs a loss from every training_step; it returned None")
        gradients.adopt(self._evaluations[-1], loss)  # what backward left in param.grad: cached as it is
        for partition, entry in gradients.fresh.items():
            cache.put(partition, entry, version, copy=False)
        valid = cache.valid(version)
        # Tandon's naive pipelined code needs every held partition (its cache never expires): after a rejoin
        # (empty cache) such a rank stays a straggler until its cache is full again. Other codes use what this
        # step evaluated plus the valid cache entries.
        if scheme.cache_max_age is None and len(valid) < len(cache.partitions):
            return time.monotonic()
        entries = valid
        if self._staleness.kind == "delay_compensation":  # it rewrites stale entries: flat copies of those
            entries = {j: gradients.flat(e) for j, e in valid.items()}
        entries = self._staleness.compensate(entries, cache.versions(), version, gradients.grad_numel)
        code = runtime.new_code(version)
        gradients.encode(scheme.code_coefficients(self.global_rank, tuple(entries)), entries, code.flat)
        if gradients.buffers:
            code.write(gradients.grad_numel + 1, gradients.flat_buffers(code.rows.dtype))
        if not gradients.finite(code.flat):  # the one finite check: a NaN or inf in any entry or buffer reaches it
            self._reject(version, code.flat, valid)
            return time.monotonic()
        sent = time.monotonic()
        partition = self._evaluations[0] if isinstance(scheme, BoundedScheme) else -1
        runtime.submit(
            version, code, tuple(cache.ages(version).values()), partition=partition, busy_s=sent - self._step_began
        )
        cache.evict(version + 1)  # entries no later version can use: freed now, not when they are replaced
        return sent

    def _reject(self, version: int, code: Tensor, valid: Mapping[int, Any]) -> None:
        """This rank's code for ``version`` is not finite: raise (``nonfinite="raise"``), or evict the gradients that
        made it so and tell the leader (a straggler for this version). Buffers that are not finite (e.g. BatchNorm
        statistics) are replaced by the aggregate's, the other ranks' mean."""
        runtime, cache, gradients = self.runtime, self.cache, self.gradients
        assert runtime is not None and cache is not None
        if gradients.finite(code, buffers=False):
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"PGC rank {self.global_rank}: the buffers (e.g. BatchNorm running statistics) at step {version} "
                    "contain NaN or inf; pass PGCStrategy(nonfinite='skip') to drop such codes and go on (the rank "
                    "then takes the other ranks' buffers)"
                )
            bad: list[int] = []
            log.warning(
                "PGC rank %d: non-finite buffers at step %d (e.g. BatchNorm running statistics): not sent; this rank "
                "takes the other ranks' buffers with the aggregate",
                self.global_rank,
                version,
            )
        else:
            bad = gradients.nonfinite(valid) or sorted(gradients.fresh)  # (none alone: the sum overflowed)
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"PGC rank {self.global_rank}: the gradient (or loss) of partition(s) {bad} at step {version} "
                    "contains NaN or inf; lower the learning rate or clip gradients, or pass "
                    "PGCStrategy(nonfinite='skip') to drop such gradients and go on"
                )
            log.warning(
                "PGC rank %d: non-finite gradient at step %d (partitions %s): not sent, evicted from the cache",
                self.global_rank,
                version,
                bad,
            )
        for p in bad:
            cache.discard(p)
        runtime.reject(version)  # a straggler for this version: no code
        cache.evict(version + 1)

    # ------------------------------------------------------------------------------------------ registry
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, (description, kwargs) in REGISTERED.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)


def _loss_of(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    raise RuntimeError("PGCStrategy needs training_step to return a loss tensor (or a dict with a 'loss' key)")
