"""Curve helpers shared by the demo, the benchmark grid and the tests: one meaning each.

A curve here is a sequence of values sampled at increasing indices (steps or validation points). Between two
samples it is taken as linear, so a crossing of a curve sampled every ``k`` steps is not rounded up to the next
sample, and the time/step at a crossing is read off the matching sequence with :func:`at_index`.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

__all__ = ["at_index", "crossing", "cumulative_at", "first_crossing", "interpolate", "smoothed"]


def smoothed(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start).

    Args:
        values: the raw curve, e.g. per-step training losses.
        window: samples in the mean (>= 1); 1 returns the values unchanged.

    Raises:
        ValueError: ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def first_crossing(values: Sequence[float], target: float) -> Optional[float]:
    """Fractional index at which the piecewise-linear ``values`` first reach ``<= target`` (``None``: never).

    Between the last point above the target and the first at or below it the curve is taken as linear; a
    curve that starts at or below the target crosses at index 0.
    """
    for i, v in enumerate(values):
        if v <= target:
            if i == 0:
                return 0.0
            above = values[i - 1]
            return (i - 1) + (above - target) / (above - v)
    return None


def at_index(xs: Sequence[float], index: float) -> float:
    """``xs`` linearly interpolated at a fractional index (clamped to the last element)."""
    i = min(int(math.floor(index)), len(xs) - 1)
    if i >= len(xs) - 1:
        return float(xs[-1])
    return xs[i] + (xs[i + 1] - xs[i]) * (index - i)


def crossing(xs: Sequence[float], values: Sequence[float], target: float) -> Optional[float]:
    """``xs`` (wall seconds, steps, ...) at the :func:`first_crossing` of ``values``; ``None`` if never reached."""
    index = first_crossing(values, target)
    return None if index is None else at_index(xs, index)


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> Optional[float]:
    """Linear interpolation of the piecewise-linear curve (``xs`` increasing) at ``x``; ``None`` outside it."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[0]  # a single point, x == xs[0]


def cumulative_at(per_step: Sequence[float], step: float) -> float:
    """Sum of ``per_step[t]`` over the steps ``t < step`` (the work that produced model version ``step``),
    linear within a step."""
    whole = int(math.floor(step))
    total = float(sum(per_step[:whole]))
    if whole < len(per_step):
        total += per_step[whole] * (step - whole)
    return total
