"""PGCStrategy: the Lightning glue of pipelined gradient coding. The math is in :mod:`lightning_pgc.codes`, the
messaging in :mod:`lightning_pgc.runtime`; this module only connects them to Lightning's training loop.

Per optimizer step ``t`` (= the model version, Invariant 1) every rank:

1. skips forward/backward if the aggregate of ``t`` is already published (it fell behind: Invariant 3);
2. otherwise runs the training step on the partitions ``scheme.evaluations(rank, t)`` (one mini-batch chunk
   per partition), stores each partition gradient in its stale cache, encodes the valid entries and sends
   the code to the coordinator;
3. writes the published aggregate into ``param.grad`` and lets its own optimizer step, so every replica
   applies the identical sequence of aggregates (Invariant 2).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader

import lightning.pytorch as pl
from lightning_pgc.codes import SCHEMES, StaleCache, make_scheme
from lightning_pgc.data import PartitionBatchSampler, split_batch
from lightning_pgc.runtime import GlooTransport, PGCRuntime
from lightning_pgc.runtime.transport import payload_dtype_for

log = logging.getLogger(__name__)

#: Registered names -> (scheme, tolerated stragglers); ``None`` keeps the constructor's ``stragglers``.
REGISTERED: dict[str, tuple[str, Optional[int], str]] = {
    "pgc": ("pgc_cr", 1, "Pipelined gradient coding, cyclic repetition, tolerates 1 straggler"),
    "pgc_cr": ("pgc_cr", 1, "Pipelined gradient coding with cyclic repetition (s=1)"),
    "pgc_fr": ("pgc_fr", 1, "Pipelined gradient coding with fractional repetition (s=1)"),
    "gc_cr": ("gc_cr", 1, "Gradient coding (Tandon et al.) with cyclic repetition (s=1)"),
    "gc_fr": ("gc_fr", 1, "Gradient coding with fractional repetition (s=1)"),
    "ignore_stragglers": ("ignore", 1, "Average the fastest n-1 gradients, ignore the slowest rank"),
    "dgd": ("dgd", 0, "Distributed gradient descent through the PGC runtime (waits for all ranks)"),
}


@dataclass
class StepInfo:
    """What this rank did for one version (read by :class:`~lightning_pgc.PGCDiagnostics`)."""

    version: int
    loss: float
    skipped: bool  # applied a published aggregate without computing
    evaluated: tuple[int, ...]  # partitions evaluated fresh at this version
    worker_wait_s: float  # from sending the code to holding the aggregate
    aggregate: Tensor  # flat gradient part of the aggregate


class PGCStrategy(DDPStrategy):
    """Data-parallel training that never waits for the ``stragglers`` slowest ranks.

    Args:
        scheme: one of ``dgd``, ``ignore``, ``gc_fr``, ``gc_cr``, ``pgc_fr``, ``pgc_cr``, ``pgc_cr_naive``.
        stragglers: ``s``, how many of the slowest ranks each step may ignore (``c = s + 1`` copies per partition).
        warmup: ``"full"`` evaluates every held partition at the first step (the paper), ``"gradual"`` fills
            the cache over the first ``c`` steps at no extra cost.
        timeout: liveness bound in seconds: the coordinator fails, naming the missing ranks, when it cannot
            close a version this long after the first code arrived; a rank fails when no aggregate comes.
        max_lag: how many versions a live rank may fall behind before the coordinator waits for it; bounds the
            aggregates a slow rank buffers. Default: as many as fit in 512 MiB, between ``c`` and 1024.
        seed: seed of the partition split and of each partition's mini-batch stream.
        diagnostics: attach :class:`~lightning_pgc.PGCDiagnostics` unless one is already there.
        diagnostics_every: steps between the probe-batch diagnostics (displacement, ``L_hat``).
        max_condition: largest worst-case condition number accepted for Tandon-coded cyclic schemes.
        process_group_timeout: timeout of Lightning's default process group (as ``DDPStrategy(timeout=...)``).
        start_method: how Lightning launches the ranks, as for ``ddp``.
    """

    strategy_name = "pgc"

    def __init__(
        self,
        scheme: str = "pgc_cr",
        stragglers: int = 1,
        warmup: Literal["full", "gradual"] = "full",
        timeout: float = 300.0,
        max_lag: Optional[int] = None,
        seed: int = 0,
        diagnostics: bool = True,
        diagnostics_every: int = 25,
        max_condition: float = 1e8,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        process_group_timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
        if warmup not in ("full", "gradual"):
            raise ValueError(f"warmup must be 'full' or 'gradual', got {warmup!r}")
        if scheme == "pgc_cr_naive" and warmup != "full":
            raise ValueError("pgc_cr_naive decodes Tandon codes and needs every cache entry: use warmup='full'")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        if max_lag is not None and max_lag < 1:
            raise ValueError(f"max_lag must be >= 1 or None, got {max_lag}")
        if diagnostics_every < 1:
            raise ValueError(f"diagnostics_every must be >= 1, got {diagnostics_every}")
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
        self.warmup = warmup
        self.liveness_timeout = float(timeout)
        self.max_lag = max_lag
        self.seed = seed
        self.diagnostics = diagnostics
        self.diagnostics_every = diagnostics_every
        self.max_condition = max_condition
        self.scheme: Any = None
        self.runtime: Optional[PGCRuntime] = None
        self.cache: Optional[StaleCache] = None
        self.last_step: Optional[StepInfo] = None
        self.skipped_steps = 0
        self.buffer_stats: dict[str, int] = {}
        self._params: list[torch.nn.Parameter] = []
        self._buffers: list[Tensor] = []
        self._payload_dtype = torch.float32
        self._warm_start: Optional[int] = None
        self._version = 0
        self._evaluations: tuple[int, ...] = ()
        self._fresh: dict[int, Tensor] = {}

    # ------------------------------------------------------------------------------------------ configuration
    def _make_scheme(self, world_size: int) -> Any:
        return make_scheme(
            self.scheme_name,
            world_size,
            self.stragglers,
            warmup=self.warmup,
            seed=self.seed,
            max_condition=self.max_condition,
        )

    def _configure_launcher(self) -> None:
        # Validate (n, s) in the launching process, before any rank starts.
        if self.parallel_devices is not None:
            self._make_scheme(self.num_nodes * len(self.parallel_devices))
        super()._configure_launcher()

    def setup_environment(self) -> None:
        super().setup_environment()
        self.scheme = self._make_scheme(self.world_size)

    def _warm_start_step(self) -> int:
        """The step at which this fit's caches were empty (fit start, or the step a checkpoint resumed at)."""
        if self._warm_start is None:
            self._warm_start = self.lightning_module.trainer.global_step
        return self._warm_start

    def setup(self, trainer: "pl.Trainer") -> None:
        self._warm_start = None
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_supported(trainer)
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            _drop_per_step_sigterm_broadcast(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.diagnostics:
            from lightning_pgc.callbacks import PGCDiagnostics

            if not any(isinstance(cb, PGCDiagnostics) for cb in trainer.callbacks):
                trainer.callbacks.append(PGCDiagnostics(every_n_steps=self.diagnostics_every))

    def _check_supported(self, trainer: "pl.Trainer") -> None:
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise ValueError("PGCStrategy needs automatic optimization (`self.automatic_optimization = True`)")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "PGCStrategy does not support `accumulate_grad_batches`: raise the DataLoader's batch_size instead"
            )
        precision = str(trainer.precision)
        if precision.startswith("16"):
            raise ValueError(
                f"PGCStrategy does not support precision={precision!r} (loss scaling would have to agree across "
                "stale gradients); use '32-true' or 'bf16-mixed'"
            )

    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper (it would all-reduce every backward); just start from rank 0's weights.
        assert self.model is not None
        _sync_module_states(self.model)

    # ------------------------------------------------------------------------------------------------- data
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        if isinstance(dataloader.batch_sampler, PartitionBatchSampler):
            return dataloader
        if dataloader.batch_size is None:
            raise ValueError(
                "PGCStrategy assigns mini-batches to partitions itself: give the training DataLoader a `batch_size` "
                "instead of a custom `batch_sampler`"
            )
        dataset = dataloader.dataset
        if not hasattr(dataset, "__len__"):
            raise ValueError("PGCStrategy needs a map-style training dataset (with __len__)")
        sampler = PartitionBatchSampler(
            len(dataset),
            self.scheme,
            rank=self.global_rank,
            batch_size=dataloader.batch_size,
            seed=self.seed,
            base_step=lambda: trainer.global_step,
            warmup_step=self._warm_start_step,
        )
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=dataloader.num_workers,
            collate_fn=dataloader.collate_fn,
            pin_memory=dataloader.pin_memory,
            timeout=dataloader.timeout,
            worker_init_fn=dataloader.worker_init_fn,
            multiprocessing_context=dataloader.multiprocessing_context,
            persistent_workers=dataloader.persistent_workers if dataloader.num_workers > 0 else False,
        )

    # ---------------------------------------------------------------------------------------------- runtime
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        self._params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        # Buffers (BatchNorm statistics) travel as a plain tail, averaged over the received ranks, so that the
        # replicas stay identical buffers included (DDP broadcasts rank 0's buffers instead).
        self._buffers = [b for b in self.lightning_module.buffers() if b.numel() > 0]
        buffer_numel = sum(b.numel() for b in self._buffers)
        numel = sum(p.numel() for p in self._params) + 1 + buffer_numel  # gradient, loss slot, buffers
        dtype = self._payload_dtype = payload_dtype_for(self._params[0].dtype if self._params else torch.float32)
        scheme = self.scheme
        self.cache = StaleCache(scheme.partitions(self.global_rank), max_age=scheme.cache_max_age)
        self._version = trainer.global_step
        if self._warm_start_step() != trainer.global_step:
            raise RuntimeError(f"PGC: training starts at step {trainer.global_step}, data was laid out for step "
                               f"{self._warm_start}")
        message_bytes = numel * torch.empty((), dtype=dtype).element_size()
        max_lag = self.max_lag or int(min(1024, max(scheme.c + 1, (512 << 20) // message_bytes)))
        self.runtime = PGCRuntime(
            scheme,
            GlooTransport(),
            rank=self.global_rank,
            world_size=self.world_size,
            payload_numel=numel,
            down_dtype=dtype,
            start_version=trainer.global_step,
            timeout=self.liveness_timeout,
            max_lag=max_lag,
            plain_numel=buffer_numel,
        )
        self.runtime.start()
        self.skipped_steps = 0

    def on_train_end(self) -> None:
        self._stop_runtime()
        super().on_train_end()

    def _stop_runtime(self) -> None:
        if self.runtime is not None:
            self.runtime.stop()
            self.buffer_stats = self.runtime.buffer_stats()
            if self.cache is not None:
                self.buffer_stats["cache_bytes"] = self.cache.nbytes
            self.runtime = None
        self.cache = None

    def teardown(self) -> None:
        self._stop_runtime()
        super().teardown()

    # ------------------------------------------------------------------------------------------ the step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the user's training step once per evaluated partition; all but the last are back-propagated here."""
        evals = self._evaluations
        if len(evals) <= 1 or not args:
            return super().training_step(*args, **kwargs)
        chunks = split_batch(args[0], len(evals))
        self._zero_grad()  # Lightning zeroes grads only after training_step: drop the previous aggregate now
        for partition, chunk in zip(evals[:-1], chunks[:-1]):
            output = super().training_step(chunk, *args[1:], **kwargs)
            loss = _loss_of(output)
            self.backward(loss, None)
            self._fresh[partition] = self._flat_gradient(loss)
            self._zero_grad()
        return super().training_step(chunks[-1], *args[1:], **kwargs)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        if self.runtime is None:  # e.g. an optimizer step outside fit's training loop
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        version = self._version = self.lightning_module.trainer.global_step
        self._evaluations = self.scheme.evaluations(self.global_rank, version, start=self._warm_start_step())

        def pgc_closure() -> Any:
            return self._exchange(version, closure)

        return super().optimizer_step(optimizer, pgc_closure, model, **kwargs)

    def _exchange(self, version: int, closure: Callable[[], Any]) -> Tensor:
        runtime, cache = self.runtime, self.cache
        assert runtime is not None and cache is not None
        skipped = runtime.published(version)
        waited = 0.0
        if not skipped:
            self._fresh = {}
            closure()
            result = getattr(closure, "_result", None)
            if result is not None and result.loss is None:
                raise RuntimeError("PGCStrategy needs a loss from every training_step; it returned None")
            self._fresh[self._evaluations[-1]] = self._flat_gradient(result.loss if result is not None else None)
            for partition, payload in self._fresh.items():
                cache.put(partition, payload, version, copy=False)  # payload is a fresh tensor
            self._fresh = {}
            valid = cache.valid(version)
            ages = tuple(cache.ages(version).values())
            code = self.scheme.encode(self.global_rank, valid)
            if self._buffers:
                code = torch.cat([code, self._flat_buffers(code.dtype)])
            start = time.monotonic()
            runtime.submit(version, code, ages)
            aggregate = runtime.wait(version)
            waited = time.monotonic() - start
        else:
            self.skipped_steps += 1
            aggregate = runtime.wait(version)
        n_grad = aggregate.numel() - 1 - sum(b.numel() for b in self._buffers)
        gradient, loss, buffers = aggregate[:n_grad], aggregate[n_grad], aggregate[n_grad + 1 :]
        self._apply(gradient)
        self._load_buffers(buffers)
        loss_t = loss.to(torch.float32).clone()
        if hasattr(closure, "_result"):
            if skipped:
                closure._result = ClosureResult(None)
            closure._result.loss = loss_t
        self.last_step = StepInfo(version, float(loss_t), skipped, () if skipped else self._evaluations, waited,
                                  gradient)
        return loss_t

    def _flat_gradient(self, loss: Optional[Tensor]) -> Tensor:
        """This rank's current ``param.grad`` as one flat vector, with the loss value appended."""
        dtype = self._payload_dtype
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).to("cpu", dtype)
            for p in self._params
        ]
        value = torch.zeros(1, dtype=dtype) if loss is None else loss.detach().reshape(1).to("cpu", dtype)
        return torch.cat(parts + [value])

    def _flat_buffers(self, dtype: torch.dtype) -> Tensor:
        return torch.cat([b.detach().reshape(-1).to("cpu", dtype) for b in self._buffers])

    def _load_buffers(self, flat: Tensor) -> None:
        offset = 0
        for b in self._buffers:
            values = flat[offset : offset + b.numel()].view_as(b)
            if not b.dtype.is_floating_point:
                values = values.round()
            b.copy_(values.to(device=b.device, dtype=b.dtype))
            offset += b.numel()

    def _zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def _apply(self, gradient: Tensor) -> None:
        """Write the aggregate into ``param.grad`` (what clipping, callbacks and the optimizer then see)."""
        offset = 0
        for p in self._params:
            n = p.numel()
            p.grad = gradient[offset : offset + n].view_as(p).to(device=p.device, dtype=p.dtype)
            offset += n

    # ------------------------------------------------------------------------------------------ registry
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, (scheme, s, description) in REGISTERED.items():
            if name in strategy_registry:
                continue
            kwargs: dict[str, Any] = {"scheme": scheme}
            if s is not None:
                kwargs["stragglers"] = s
            strategy_registry.register(name, cls, description=description, **kwargs)


def _drop_per_step_sigterm_broadcast(trainer: "pl.Trainer") -> None:
    """Lightning 2.6 broadcasts a SIGTERM flag from rank 0 on the default group before *every* training batch;
    that collective makes each rank wait for the slowest one and would defeat straggler tolerance. Under PGC a
    SIGTERM is handled on the rank that received it (the others then stop on the runtime's timeout)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    epoch_loop = trainer.fit_loop.epoch_loop

    def local_sigterm_check() -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()

    epoch_loop._broadcast_sigterm_tensor = local_sigterm_check  # type: ignore[method-assign]


def _loss_of(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    raise RuntimeError("PGCStrategy needs training_step to return a loss tensor (or a dict with a 'loss' key)")
