"""Lightning's launchers, made to survive dead ranks: the ``popen`` and ``fork``/``spawn`` launchers as subclasses
that kill nobody while the job runs, with the strategy's preflight run before any rank starts.

Checked against lightning 2.6.6 (see the ``lightning`` pin in pyproject.toml); each private attribute used is
named with that version where it is used.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import pickle
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch.multiprocessing as mp
from typing_extensions import override
from lightning.fabric.strategies.launchers.multiprocessing import (  # 2.6.6: the launcher's start checks
    _check_bad_cuda_fork,
    _check_missing_main_guard,
)
from lightning.fabric.utilities import move_data_to_device
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed  # 2.6.6: OMP threads per rank
from lightning.pytorch.strategies.launchers.multiprocessing import (  # 2.6.6: fork/spawn launcher
    _GlobalStateSnapshot,
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher  # 2.6.6: popen
from lightning.pytorch.trainer.call import _interrupt  # 2.6.6: on_exception hooks of an interrupted run
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

import lightning.pytorch as pl

__all__ = [
    "Preflight",
    "SurvivingMultiprocessingLauncher",
    "SurvivingSubprocessLauncher",
    "launches_in_rank_zero",
    "mark_launching_rank",
    "surviving_launcher",
    "wrap_launcher",
]

log = logging.getLogger("lightning_pgc._lightning")

#: ``preflight(trainer, launch_args)``: checks run in the launching process before any rank starts.
Preflight = Callable[["pl.Trainer", tuple[Any, ...]], None]


def wrap_launcher(strategy: Any, wrap: Callable[[Any], Any]) -> None:
    """Replace the strategy's launcher by ``wrap(launcher)`` (2.6.6: ``DDPStrategy._configure_launcher`` sets
    ``strategy._launcher``; ``trainer.fit`` then calls ``strategy.launcher.launch(trainer._fit_impl, model,
    train_dataloaders, val_dataloaders, datamodule, ckpt_path, trainer=trainer)`` in the launching process, before
    any rank starts, in ``lightning/pytorch/trainer/call.py``)."""
    launcher = getattr(strategy, "_launcher", None)
    if launcher is not None:
        strategy._launcher = wrap(launcher)


# ------------------------------------------------------------------------------------------------ launchers
# Lightning's launchers end the whole job when one rank dies: the popen launcher's ``_ChildProcessObserver``
# (lightning/fabric/strategies/launchers/subprocess_script.py, 2.6.6) SIGKILLs every process a few seconds after
# a child exits non-zero, and the fork/spawn launcher joins through ``torch.multiprocessing``'s
# ``ProcessContext.join``, which terminates every process and raises at the first failed child. PGC survives up
# to ``s`` dead ranks, so it launches with the subclasses below: nobody is killed while the job runs; the
# launching process fails if rank 0 (the leader) fails, and reaps every child, killing those still running
# ``grace_s`` seconds after the child's work ended for rank 0: its Trainer call (fork/spawn children run one call)
# or its script (popen children run the whole script).


def _reap(
    procs: list[Any],
    alive: Callable[[Any], bool],
    kill: Callable[[Any], object],
    code: Callable[[Any], Optional[int]],
    grace_s: float,
    first_rank: int,
    error: Callable[[int], str] = lambda i: "",
    after: str = "rank 0 returned",
) -> None:
    """Wait up to ``grace_s`` for ``procs`` (ranks ``first_rank``, ...) to exit, then kill the rest; log the ranks
    that exited with a non-zero status (with ``error(i)``, the last line of the error of the ``i``-th, if known)."""
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for i, p in enumerate(procs):
        if alive(p):
            log.warning(
                "lightning_pgc: rank %d (pid %s) still runs %.0f s after %s: killed",
                first_rank + i,
                p.pid,
                grace_s,
                after,
            )
            kill(p)
        elif code(p):
            log.warning(
                "lightning_pgc: rank %d (pid %s) exited with status %s%s",
                first_rank + i,
                p.pid,
                code(p),
                error(first_rank + i),
            )


class SurvivingSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher (2.6.6 ``_SubprocessScriptLauncher``) without the observer that SIGKILLs
    every rank when one child exits non-zero. Rank 0 runs in the launching process. Ranks 1..n-1 run the whole
    script, as under ``ddp``: every later Trainer call of the script (``validate``, ``test``, a second ``fit``)
    runs in the same processes. So the children are reaped when the launching process's script ends, not when a
    Trainer call returns: they get ``grace_s`` seconds to exit after it, then are killed."""

    def __init__(self, base: _SubprocessScriptLauncher, grace_s: float, preflight: Optional[Preflight] = None) -> None:
        super().__init__(base.cluster_environment, base.num_processes, base.num_nodes)
        self.grace_s = grace_s
        self.preflight = preflight

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        if self.preflight is not None and trainer is not None:
            self.preflight(trainer, args)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            # 2.6.6: starts ranks 1..n-1, fills ``self.procs`` and sets ``LOCAL_RANK`` in this process, so the
            # script's later launches (any Trainer) start no more children
            self._call_children_scripts()
            atexit.register(
                _reap,
                list(self.procs),
                lambda p: p.poll() is None,
                lambda p: (p.kill(), p.wait()),
                lambda p: p.returncode,
                self.grace_s,
                first_rank=1,
                after="the script ended",
            )
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class SurvivingMultiprocessingLauncher(_MultiProcessingLauncher):
    """Lightning's ``fork``/``spawn``/``forkserver`` launcher (2.6.6 ``_MultiProcessingLauncher``) with a join that
    tolerates dead ranks: it waits for rank 0, which returns the results; the launching process raises only if
    rank 0 failed. Other ranks get ``grace_s`` seconds after rank 0 to exit, then are killed."""

    def __init__(
        self,
        base: _MultiProcessingLauncher,
        grace_s: float,
        failover: bool = False,
        preflight: Optional[Preflight] = None,
    ) -> None:
        super().__init__(base._strategy, base._start_method)
        self.grace_s = grace_s
        self.failover = failover
        self.preflight = preflight
        self._results: Any = None  # the return queue, for a rank that took over from rank 0

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        if self.preflight is not None and trainer is not None:
            self.preflight(trainer, args)
        # 2.6.6: the same checks, environment and process arguments as ``_MultiProcessingLauncher.launch``.
        if self._start_method in ("fork", "forkserver"):
            _check_bad_cuda_fork()
        if self._start_method == "spawn":
            _check_missing_main_guard()
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise NotImplementedError(
                "fit() twice on one Trainer with a spawn-based strategy is not supported by "
                "Lightning; create a new Trainer and pass fit(ckpt_path=...)"
            )
        assert self._strategy.cluster_environment is not None
        os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)
        return_queue = self._results = mp.get_context(self._start_method).SimpleQueue()
        process_args: list[Any] = [trainer, function, args, kwargs, return_queue]
        if self._start_method == "spawn":
            process_args.append(_GlobalStateSnapshot.capture())
        process_args[1] = functools.partial(_run_rank, trainer, function)
        context = mp.start_processes(
            self._wrapping_function,
            args=tuple(process_args),
            # Lightning types the launcher's strategy as a ParallelStrategy, though its own launch reads DDPStrategy's
            # ``num_processes`` here too (every strategy it launches for is one)
            nprocs=self._strategy.num_processes,  # type: ignore[attr-defined]
            start_method=self._start_method,
            join=False,
        )
        self.procs = context.processes
        rank0, others = self.procs[0], self.procs[1:]
        rank0.join()
        outputs = _drain(return_queue)  # rank 0's output; None if another rank took over (it froze)
        if self.failover and trainer is not None and not any(o is not None for o in outputs):
            # rank 0 died, or froze and stepped down: the rank that took over returns the results when it ends
            while not any(o is not None for o in outputs) and any(p.is_alive() for p in others):
                time.sleep(0.1)
                outputs += _drain(return_queue)
        _reap(
            others,
            lambda p: p.is_alive(),
            lambda p: (p.kill(), p.join()),
            lambda p: p.exitcode,
            self.grace_s,
            first_rank=1,
            error=lambda i: (
                ": " + _child_error(context, i).strip().splitlines()[-1] if _child_error(context, i) else ""
            ),
        )
        outputs += _drain(return_queue)
        led = [o for o in outputs if o is not None] if trainer is not None else outputs
        if rank0.exitcode != 0 and not led:
            raise RuntimeError(
                f"lightning_pgc: rank 0 (the PGC leader) exited with status {rank0.exitcode}:\n"
                + (_child_error(context, 0) or "(no Python error: killed by a signal?)")
            )
        if rank0.exitcode != 0:
            log.warning(
                "lightning_pgc: rank 0 (the first PGC leader) exited with status %s; the rank that took over "
                "finished the job",
                rank0.exitcode,
            )
        if outputs and not led:
            raise RuntimeError(
                "lightning_pgc: rank 0 stepped down as leader (it froze) and no rank returned the fit's "
                "results; see the ranks' errors above"
            )
        if not led:
            # Rank 0 exited 0 without results: a SIGTERM stopped it (``SIGTERMException`` is a ``SystemExit``, exit
            # status 0, as under ``ddp``), after its own on-exception hooks ran. Raising here would run the
            # on-exception hooks again in this process, on the untrained model (e.g. overwrite OnExceptionCheckpoint's
            # file), so the launch just ends, interrupted.
            if trainer is not None:
                trainer.state.status = TrainerStatus.INTERRUPTED
            log.warning("lightning_pgc: rank 0 stopped on SIGTERM; the job ends without results")
            return None
        worker_output = led[0]
        if trainer is None:
            return worker_output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        self._recover_results_in_main_process(worker_output, trainer)
        return worker_output.trainer_results

    @override
    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional[_WorkerOutput]:
        # 2.6.6: every rank builds its state_dict, process 0 returns the output that ``_wrapping_function`` puts in
        # the queue. Here the rank doing the rank-zero work does (rank 0, or the one that took over); a successor
        # puts it itself, since ``_wrapping_function`` puts only from process 0.
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback is not None else None
        state_dict = trainer.lightning_module.state_dict()
        if not self._strategy.is_global_zero:
            return None
        weights = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights)
        output = _WorkerOutput(best, weights, trainer.state, results, self.get_extra_results(trainer))
        if self._strategy.global_rank != 0 and self._results is not None:
            self._results.put(move_data_to_device(output, "cpu"))
        return output


def _drain(results: Any) -> list[Any]:
    """Everything in a ``SimpleQueue`` now."""
    out = []
    while not results.empty():
        out.append(results.get())
    return out


def _run_rank(trainer: Optional["pl.Trainer"], function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run ``function`` in a forked or spawned rank with Lightning's exception handling around it, as every rank
    gets under ``popen`` (2.6.6: ``trainer.fit`` runs ``call._call_and_handle_interrupt`` only in the launching
    process; a forked rank's exception skips the on-exception hooks and the strategy's teardown). With it, a rank
    that fails or gets SIGTERM runs ``on_exception`` (e.g. ``ModelCheckpoint(save_on_exception=True)``) and stops
    its PGC runtime cleanly. A rank's error is printed at once: torch only hands it to the launching process when
    the rank is joined, which for a rank other than 0 may be never if the job hangs on it."""
    try:
        return function(*args, **kwargs)
    except BaseException as exc:
        if isinstance(exc, Exception):
            rank = f" {trainer.global_rank}" if trainer is not None else ""
            print(f"lightning_pgc: rank{rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if trainer is not None:
            _interrupt(trainer, exc)  # 2.6.6: TrainerStatus.INTERRUPTED, on_exception hooks, loggers finalized
            trainer._teardown()  # 2.6.6: strategy.teardown() and the loops'
            trainer.state.stage = None
        raise


def _child_error(context: Any, index: int) -> str:
    """The traceback a ``torch.multiprocessing`` child left in its error file (2.14: ``ProcessContext.error_files``
    hold a pickled ``traceback.format_exc()`` string), or ""."""
    try:
        with open(context.error_files[index], "rb") as fh:
            return str(pickle.load(fh))
    except Exception:  # no file, or an empty one: the child exited without a Python exception
        return ""


def surviving_launcher(
    launcher: Any, grace_s: float, failover: bool = False, preflight: Optional[Preflight] = None
) -> Any:
    """The launcher that survives dead ranks for Lightning's ``launcher`` (others are returned unchanged); with
    ``failover`` the fork/spawn one also survives rank 0 (its results then come from the rank that took over).

    ``preflight(trainer, args)`` runs in the launching process before any rank starts, at every Trainer call
    (2.6.6: ``trainer.fit`` calls ``launcher.launch(trainer._fit_impl, model, train_dataloaders, ...,
    trainer=trainer)`` with the model, callbacks and precision resolved). The launchers stay instances of
    Lightning's own classes: Lightning reads their type (e.g. ``predict`` returns no predictions under fork/spawn).
    """
    if type(launcher) is _SubprocessScriptLauncher:
        return SurvivingSubprocessLauncher(launcher, grace_s, preflight)
    if type(launcher) is _MultiProcessingLauncher:
        return SurvivingMultiprocessingLauncher(launcher, grace_s, failover, preflight)
    return launcher


# --------------------------------------------------------------------------------------- the launching rank
# Whether rank 0 is the launching process decides whether the PGC leader's death can be survived (failover).
_LAUNCHING_RANK = "LIGHTNING_PGC_RANK0_LAUNCHES"  # set by rank 0 before it starts the others (inherited)


def mark_launching_rank(launcher: Any) -> None:
    """In the launching process, before any rank starts: record (in the environment the ranks inherit) whether
    rank 0 is the launching process itself (2.6.6: ``_SubprocessScriptLauncher`` runs rank 0 in the process that
    called ``fit`` unless the cluster created the processes, e.g. SLURM or torchrun)."""
    if (
        isinstance(launcher, _SubprocessScriptLauncher)
        and not launcher.cluster_environment.creates_processes_externally
    ):
        os.environ[_LAUNCHING_RANK] = "1"
    elif _LAUNCHING_RANK in os.environ and not isinstance(launcher, _SubprocessScriptLauncher):
        del os.environ[_LAUNCHING_RANK]  # a fork/spawn job after a popen one in the same process


def launches_in_rank_zero(strategy: Any) -> bool:
    """Whether rank 0 of this job is the process that launched it (then its death is the job's end)."""
    return os.environ.get(_LAUNCHING_RANK) == "1" and getattr(strategy, "_start_method", None) == "popen"
