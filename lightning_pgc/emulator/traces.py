"""Replay of recorded step traces with block resampling: delays that keep a trace's stall durations.

A step trace (:class:`~lightning_pgc.step_trace.StepTimeTrace`) holds every rank's *own* time per step, ``[R, T]``.
The typical step (the median over all ranks and steps) is taken as compute; what a rank spends above it at a step
is that rank's delay there (:func:`trace_delays`).

**Block resampling** (the circular block bootstrap). The emulated run is cut into blocks of ``L`` consecutive steps;
block ``b`` replays the recorded steps ``i_b, i_b + 1, ..., i_b + L - 1`` (modulo ``T``) with ``i_b`` drawn uniformly
from ``(seed, copy, b)``. Every recorded rank replays its *own* row at the same recorded steps, so

- a persistently slow rank stays slow (its row is slow everywhere);
- stalls that hit several ranks at once stay together (the same recorded step for every rank);
- a stall of ``k <= L`` consecutive steps survives intact whenever a block contains it: per block with probability
  ``(L - k + 1) / T``, so over ``T`` resampled steps ``(L - k + 1) / L`` intact copies are expected against the
  trace's one (more may form across block edges). Single-step resampling (``L = 1``) keeps a ``k``-step stall only
  by chance, at rate about ``f^(k-1)`` for a stall fraction ``f``.

**The block length** (:func:`block_length`): ``L = min(T, max(4 k_max, ceil(T^(1/3)), 2))``, ``k_max`` the longest
stall of the trace (:func:`stall_runs`). ``4 k_max`` keeps at least three quarters of every stall's copies intact
(``(L - k + 1) / L >= 3/4``); ``T^(1/3)`` is the rate of the block bootstrap's bias-variance balance for a
short-memory series. A trace whose longest stall exceeds a quarter of its length cannot be cut without breaking it:
then ``L = T`` and every resample is a rotation of the whole trace.

**More emulated ranks than recorded ones** (the map at ``n > R``): rank ``k`` replays row ``k mod R``, and copy
``k // R`` draws its own block starts, so the copies are independent resamples of the same cluster.

**For the map**: the straggler pattern ``"trace:PATH"`` of :func:`lightning_pgc.emulator.cluster.delay_model` is
:func:`lightning_pgc.emulator.cluster.trace_delay_model` ``(PATH, n, seed)``: a :class:`TraceDelays` of the
trace's delays scaled so that its typical step is the map's compute of one gradient (``COMPUTE_S``), so a trace
recorded on any hardware plays at the map's time unit, with its ratio of delay to compute kept.

Pure: numpy only (no Lightning, no torch.distributed); only :func:`load_trace` imports the callback's module, for
the file format's name.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from lightning_pgc.delays import DelayModel

__all__ = [
    "STALL_FRACTION",
    "Trace",
    "TraceDelays",
    "block_length",
    "load_trace",
    "resample_index",
    "stall_runs",
    "trace_delays",
]

#: a rank is stalled at a step when its own time exceeds its own median by more than this fraction of the trace's
#: typical step (a persistently slow rank is not stalled: its median is its usual pace)
STALL_FRACTION = 0.5


@dataclass(frozen=True)
class Trace:
    """A step trace as :func:`load_trace` reads it.

    Attributes:
        own: ``[R ranks, T steps]`` own step times in seconds.
        allreduce_s: the measured time of one all-reduce of the model's gradient (``None``: not recorded, e.g. a
            trace written before the callback measured it, or a 1-rank run).
        grad_numel: elements of that gradient (``None``: not recorded).
        path: the file it was read from.
    """

    own: np.ndarray
    allreduce_s: Optional[float] = None
    grad_numel: Optional[int] = None
    path: Optional[Path] = None

    @property
    def n(self) -> int:
        return int(self.own.shape[0])

    @property
    def steps(self) -> int:
        return int(self.own.shape[1])

    @property
    def compute_s(self) -> float:
        """The typical own step: the median over every rank and step."""
        return float(np.median(self.own))

    @property
    def ratio(self) -> Optional[float]:
        """Compute-to-communication ratio: typical own step / one all-reduce of the gradient (``None``: no
        all-reduce measured)."""
        if self.allreduce_s is None or self.allreduce_s <= 0:
            return None
        return self.compute_s / self.allreduce_s


def load_trace(path: str | Path) -> Trace:
    """Read a trace file written by :class:`~lightning_pgc.step_trace.StepTimeTrace`.

    Raises:
        ValueError: not a step trace, fewer than 2 ranks, fewer than 5 steps, or times that are not finite and >= 0.
    """
    from lightning_pgc.step_trace import TRACE_FORMAT  # the callback's module (Lightning): only to read a file

    path = Path(path)
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path} is not a step trace (written by lightning_pgc.step_trace.StepTimeTrace)")
    own = np.asarray(data["own_s"], dtype=np.float64)
    if own.ndim != 2 or own.shape[0] < 2:
        raise ValueError(
            f"{path}: the trace has {own.shape[0] if own.ndim == 2 else 0} rank(s); advise needs a run "
            "on 2 or more ranks"
        )
    if own.shape[1] < 5:
        raise ValueError(f"{path}: only {own.shape[1]} steps recorded; record at least 5 (better 50+)")
    if not np.isfinite(own).all() or (own < 0).any():
        raise ValueError(f"{path}: step times must be finite and >= 0")
    if float(np.median(own)) <= 0:
        raise ValueError(f"{path}: the trace's typical step time is 0 s; record a run that does some work")
    allreduce = data.get("allreduce_s")
    if allreduce is not None and not (isinstance(allreduce, (int, float)) and math.isfinite(allreduce)):
        raise ValueError(f"{path}: allreduce_s must be a number of seconds, got {allreduce!r}")
    numel = data.get("grad_numel")
    return Trace(own, None if allreduce is None else float(allreduce), None if numel is None else int(numel), path)


def trace_delays(own: np.ndarray) -> tuple[float, np.ndarray]:
    """The typical step (median of ``own``) and each rank's delay per step above it (``>= 0``)."""
    own = np.asarray(own, dtype=np.float64)
    compute = float(np.median(own))
    return compute, np.clip(own - compute, 0.0, None)


def stall_runs(own: np.ndarray, fraction: float = STALL_FRACTION) -> list[tuple[int, int, int]]:
    """The stalls of a trace: maximal runs of consecutive steps where a rank's own time exceeds its own median by more
    than ``fraction`` of the typical step, as ``(rank, first step, length)``."""
    own = np.asarray(own, dtype=np.float64)
    threshold = fraction * float(np.median(own))
    runs = []
    for rank, row in enumerate(own):
        stalled = row - np.median(row) > threshold
        start = None
        for t, hit in enumerate([*stalled.tolist(), False]):
            if hit and start is None:
                start = t
            elif not hit and start is not None:
                runs.append((rank, start, t - start))
                start = None
    return runs


def block_length(own: np.ndarray, fraction: float = STALL_FRACTION) -> int:
    """``min(T, max(4 k_max, ceil(T^(1/3)), 2))`` for a trace of ``T`` steps whose longest stall is ``k_max``."""
    steps = int(np.asarray(own).shape[1])
    longest = max((length for _, _, length in stall_runs(own, fraction)), default=0)
    return int(min(steps, max(4 * longest, math.ceil(steps ** (1 / 3)), 2)))


def resample_index(steps: int, block: int, seed: int, length: int, copy: int = 0) -> np.ndarray:
    """The recorded step each of ``length`` emulated steps replays: the circular block bootstrap with blocks of
    ``block`` steps, block starts drawn from ``(seed, copy, block number)``.

    Raises:
        ValueError: ``block`` not in ``1 .. steps``.
    """
    if not 1 <= block <= steps:
        raise ValueError(f"block length must be between 1 and the trace's {steps} steps, got {block}")
    blocks = -(-length // block)
    starts = np.array(
        [np.random.default_rng([seed, copy, 7, b]).integers(steps) for b in range(blocks)], dtype=np.int64
    )
    return ((starts[:, None] + np.arange(block)[None, :]) % steps).reshape(-1)[:length]


class TraceDelays(DelayModel):
    """Delays replayed from a trace by block resampling: rank ``k`` at emulated step ``t`` gets
    ``delays[k mod R, index_k(t)]``, ``index`` the circular block bootstrap of :func:`resample_index` (copy
    ``k // R``).

    Args:
        delays: ``[R, T]`` delays in seconds (:func:`trace_delays`).
        block: the block length (:func:`block_length`).
        seed: seed of the block starts (every arm of a comparison gets the same).
    """

    name = "trace"

    def __init__(self, delays: np.ndarray, block: int, seed: int = 0) -> None:
        delays = np.asarray(delays, dtype=np.float64)
        if delays.ndim != 2 or delays.shape[1] < 1 or not np.isfinite(delays).all() or (delays < 0).any():
            raise ValueError("delays must be a [ranks, steps] array of finite seconds >= 0")
        if not 1 <= block <= delays.shape[1]:
            raise ValueError(f"block length must be between 1 and the trace's {delays.shape[1]} steps, got {block}")
        self.delays = delays
        self.block = int(block)
        self.seed = int(seed)
        self.digest = hashlib.sha1(delays.tobytes()).hexdigest()[:16]
        self._index: dict[tuple[int, int], int] = {}

    def _start(self, copy: int, block: int) -> int:
        key = (copy, block)
        if key not in self._index:
            rng = np.random.default_rng([self.seed, copy, 7, block])
            self._index[key] = int(rng.integers(self.delays.shape[1]))
        return self._index[key]

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        rows, steps = self.delays.shape
        start = self._start(rank // rows, step // self.block)
        return float(self.delays[rank % rows, (start + step % self.block) % steps])

    def mean_seconds(self, rank: int) -> float:
        return float(self.delays[rank % self.delays.shape[0]].mean())

    def scaled(self, factor: float) -> "TraceDelays":
        return TraceDelays(self.delays * factor, self.block, self.seed)

    def _params(self) -> dict[str, Any]:
        return {"digest": self.digest, "block": self.block, "seed": self.seed}
