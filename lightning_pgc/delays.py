"""Straggler delay models: pure math (numpy, no Lightning) mapping ``(rank, step, rng)`` to a delay in seconds.

:func:`delay_for` seeds the generator from ``(seed, rank, step)`` only, so every strategy sees the *same* delay
realisation and scheme comparisons are fair. The straggler injector
(:class:`~lightning_pgc.callbacks.StragglerInjector`) sleeps these delays in real runs; the simulated clock and the
emulator read the same models.

Models have a string form for YAML and the command line (see :func:`parse_delay`)::

    "lognormal(median=0.02, sigma=0.5) + spikes(prob=0.01, low=10, high=30)"
"""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

__all__ = [
    "Constant",
    "DelayModel",
    "Exponential",
    "LogNormal",
    "NoDelay",
    "SlowRanks",
    "Spikes",
    "SumDelay",
    "delay_for",
    "parse_delay",
]


def check_seconds(name: str, value: Any) -> float:
    """A finite, non-negative float, or a ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return value


def _check_ranks(ranks: Optional[Sequence[int]], required: bool = False) -> Optional[tuple[int, ...]]:
    """A tuple of non-negative ranks (``None`` means every rank unless ``required``)."""
    if ranks is None:
        if required:
            raise ValueError("ranks must be a list of ranks, got None")
        return None
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise ValueError(f"ranks must be a list of integers, got {ranks!r}")
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
            raise ValueError(f"ranks must be non-negative integers, got {ranks!r}")
        out.append(int(r))
    return tuple(out)


def _fmt(value: Any) -> str:
    """Literal text for a parameter value that :func:`ast.literal_eval` reads back exactly."""
    if isinstance(value, tuple):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return repr(value)


class DelayModel:
    """Base class: a distribution of per-step delays (seconds >= 0) that may depend on the rank.

    Subclasses set ``name`` (the spec name) and implement :meth:`sample`, :meth:`mean_seconds`,
    :meth:`scaled` and :meth:`_params` (the keyword arguments that rebuild the model).
    """

    name: str = ""

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        """Draw the delay of ``rank`` at ``step`` from ``rng``."""
        raise NotImplementedError

    def mean_seconds(self, rank: int) -> float:
        """Analytic expected delay of ``rank`` per step."""
        raise NotImplementedError

    def scaled(self, factor: float) -> DelayModel:
        """The same model with every time multiplied by ``factor`` (keeps CPU experiments short)."""
        raise NotImplementedError

    def _params(self) -> dict[str, Any]:
        raise NotImplementedError

    def __add__(self, other: DelayModel) -> SumDelay:
        if not isinstance(other, DelayModel):
            return NotImplemented
        return SumDelay([self, other])

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._params() == other._params()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(repr(self))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={_fmt(v)}" for k, v in self._params().items() if v is not None)
        return f"{self.name}({args})"

    __str__ = __repr__


class _RankFiltered(DelayModel):
    """A model that delays only the listed ranks (``ranks=None``: all of them)."""

    def __init__(self, ranks: Optional[Sequence[int]] = None) -> None:
        self.ranks = _check_ranks(ranks)

    def applies_to(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def _ranks_list(self) -> Optional[list[int]]:
        return None if self.ranks is None else list(self.ranks)


class NoDelay(DelayModel):
    """No delay at all (the default)."""

    name = "none"

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        return 0.0

    def mean_seconds(self, rank: int) -> float:
        return 0.0

    def scaled(self, factor: float) -> NoDelay:
        check_seconds("factor", factor)
        return NoDelay()

    def _params(self) -> dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__


class Constant(_RankFiltered):
    """A fixed delay of ``seconds`` every step on ``ranks`` (None: every rank)."""

    name = "constant"

    def __init__(self, seconds: float, ranks: Optional[list[int]] = None) -> None:
        super().__init__(ranks)
        self.seconds = check_seconds("seconds", seconds)

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        return self.seconds if self.applies_to(rank) else 0.0

    def mean_seconds(self, rank: int) -> float:
        return self.seconds if self.applies_to(rank) else 0.0

    def scaled(self, factor: float) -> Constant:
        return Constant(self.seconds * check_seconds("factor", factor), self._ranks_list())

    def _params(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "ranks": self.ranks}


class Exponential(_RankFiltered):
    """Exponentially distributed delay with the given ``mean`` (memoryless jitter)."""

    name = "exponential"

    def __init__(self, mean: float, ranks: Optional[list[int]] = None) -> None:
        super().__init__(ranks)
        self.mean = check_seconds("mean", mean)

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        x = float(rng.exponential(1.0)) * self.mean  # always draw: rng use does not depend on rank
        return x if self.applies_to(rank) else 0.0

    def mean_seconds(self, rank: int) -> float:
        return self.mean if self.applies_to(rank) else 0.0

    def scaled(self, factor: float) -> Exponential:
        return Exponential(self.mean * check_seconds("factor", factor), self._ranks_list())

    def _params(self) -> dict[str, Any]:
        return {"mean": self.mean, "ranks": self.ranks}


class LogNormal(_RankFiltered):
    """Log-normal jitter ``median * exp(sigma * N(0, 1))``: the everyday slowness of shared machines."""

    name = "lognormal"

    def __init__(self, median: float, sigma: float, ranks: Optional[list[int]] = None) -> None:
        super().__init__(ranks)
        self.median = check_seconds("median", median)
        self.sigma = check_seconds("sigma", sigma)

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        x = self.median * math.exp(self.sigma * float(rng.standard_normal()))
        return x if self.applies_to(rank) else 0.0

    def mean_seconds(self, rank: int) -> float:
        return self.median * math.exp(self.sigma**2 / 2) if self.applies_to(rank) else 0.0

    def scaled(self, factor: float) -> LogNormal:
        return LogNormal(self.median * check_seconds("factor", factor), self.sigma, self._ranks_list())

    def _params(self) -> dict[str, Any]:
        return {"median": self.median, "sigma": self.sigma, "ranks": self.ranks}


class Spikes(_RankFiltered):
    """Rare stalls: with probability ``prob`` a delay uniform in ``[low, high]``, else none."""

    name = "spikes"

    def __init__(self, prob: float, low: float, high: float, ranks: Optional[list[int]] = None) -> None:
        super().__init__(ranks)
        self.prob = check_seconds("prob", prob)
        if self.prob > 1:
            raise ValueError(f"prob must be in [0, 1], got {prob!r}")
        self.low = check_seconds("low", low)
        self.high = check_seconds("high", high)
        if self.high < self.low:
            raise ValueError(f"high must be >= low, got low={low!r}, high={high!r}")

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        hit = float(rng.random()) < self.prob
        stall = self.low + (self.high - self.low) * float(rng.random())  # drawn either way: fixed rng use
        return stall if hit and self.applies_to(rank) else 0.0

    def mean_seconds(self, rank: int) -> float:
        return self.prob * (self.low + self.high) / 2 if self.applies_to(rank) else 0.0

    def scaled(self, factor: float) -> Spikes:
        f = check_seconds("factor", factor)
        return Spikes(self.prob, self.low * f, self.high * f, self._ranks_list())

    def _params(self) -> dict[str, Any]:
        return {"prob": self.prob, "low": self.low, "high": self.high, "ranks": self.ranks}


class SlowRanks(DelayModel):
    """Persistent stragglers: the listed ``ranks`` are ``seconds`` slower on every step (with ``steps=[start, stop]``
    only on the steps ``start <= step < stop``: a rank slow for a while, then normal again)."""

    name = "slowranks"

    def __init__(self, ranks: list[int], seconds: float, steps: Optional[Sequence[int]] = None) -> None:
        self.ranks = _check_ranks(ranks, required=True)
        self.seconds = check_seconds("seconds", seconds)
        if steps is not None:
            if (
                len(steps) != 2
                or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in steps)
                or not 0 <= steps[0] <= steps[1]
            ):
                raise ValueError(f"steps must be [start, stop] with 0 <= start <= stop, got {steps!r}")
            steps = (int(steps[0]), int(steps[1]))
        self.steps: Optional[tuple[int, int]] = steps

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        if self.steps is not None and not self.steps[0] <= step < self.steps[1]:
            return 0.0
        return self.mean_seconds(rank)

    def mean_seconds(self, rank: int) -> float:
        """The delay of a slow step (``steps`` aside)."""
        return self.seconds if rank in self.ranks else 0.0  # type: ignore[operator]

    def scaled(self, factor: float) -> SlowRanks:
        return SlowRanks(
            list(self.ranks),  # type: ignore[arg-type]
            self.seconds * check_seconds("factor", factor),
            None if self.steps is None else list(self.steps),
        )

    def _params(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "seconds": self.seconds, "steps": None if self.steps is None else list(self.steps)}


class SumDelay(DelayModel):
    """The sum of several models; each part draws from the same generator, in order."""

    name = "sum"

    def __init__(self, parts: list[DelayModel]) -> None:
        flat: list[DelayModel] = []
        for part in parts:
            if not isinstance(part, DelayModel):
                raise ValueError(f"SumDelay parts must be DelayModel instances, got {part!r}")
            flat.extend(part.parts if isinstance(part, SumDelay) else [part])
        if not flat:
            raise ValueError("SumDelay needs at least one part")
        self.parts: list[DelayModel] = flat

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        return sum(part.sample(rank, step, rng) for part in self.parts)

    def mean_seconds(self, rank: int) -> float:
        return sum(part.mean_seconds(rank) for part in self.parts)

    def scaled(self, factor: float) -> SumDelay:
        return SumDelay([part.scaled(factor) for part in self.parts])

    def _params(self) -> dict[str, Any]:
        return {"parts": self.parts}

    def __repr__(self) -> str:
        return " + ".join(repr(part) for part in self.parts)

    __str__ = __repr__


def delay_for(model: DelayModel, seed: int, rank: int, step: int) -> float:
    """The delay of ``rank`` at ``step``: a function of ``(seed, rank, step)`` only, whatever the strategy."""
    for name, value in (("seed", seed), ("rank", rank), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    rng = np.random.default_rng([int(seed), int(rank), int(step)])
    return max(0.0, float(model.sample(int(rank), int(step), rng)))


_MODELS: dict[str, type[DelayModel]] = {
    "none": NoDelay,
    "nodelay": NoDelay,
    "constant": Constant,
    "exponential": Exponential,
    "lognormal": LogNormal,
    "spikes": Spikes,
    "slowranks": SlowRanks,
}


def _model_class(name: str, spec: str) -> type[DelayModel]:
    key = name.lower().replace("_", "")
    if key not in _MODELS:
        valid = ", ".join(sorted(_MODELS))
        raise ValueError(f"Unknown delay model {name!r} in {spec!r}; valid names: {valid}")
    return _MODELS[key]


def _build(node: ast.AST, spec: str) -> DelayModel:
    """Turn one parsed expression node (a call, a bare name or a ``+``) into a model."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _build(node.left, spec) + _build(node.right, spec)
    if isinstance(node, ast.Constant) and node.value is None:  # "None" parses as the literal
        return NoDelay()
    if isinstance(node, ast.Name):
        return _instantiate(_model_class(node.id, spec), [], {}, spec)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        cls = _model_class(node.func.id, spec)
        if any(kw.arg is None for kw in node.keywords):
            raise ValueError(f"'**' arguments are not allowed in delay spec {spec!r}")
        args = [_literal(a, spec) for a in node.args]
        kwargs = {kw.arg: _literal(kw.value, spec) for kw in node.keywords}
        return _instantiate(cls, args, kwargs, spec)
    raise ValueError(
        f"Cannot parse delay spec {spec!r}: expected 'name(args)' terms joined by '+', "
        f"e.g. 'lognormal(median=0.02, sigma=0.5) + slowranks(ranks=[3], seconds=1.0)'"
    )


def _literal(node: ast.AST, spec: str) -> Any:
    """The value of a literal argument node (numbers, lists, ...), never evaluating code."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        raise ValueError(f"Argument {ast.unparse(node)!r} in delay spec {spec!r} is not a literal") from None


def _instantiate(cls: type[DelayModel], args: list, kwargs: dict, spec: str) -> DelayModel:
    try:
        return cls(*args, **kwargs)
    except TypeError as err:
        raise ValueError(f"Bad arguments for {cls.name!r} in {spec!r}: {err}") from None


def parse_delay(spec: str) -> DelayModel:
    """Parse a delay spec such as ``"lognormal(median=0.02, sigma=0.5) + slowranks(ranks=[3], seconds=1.0)"``.

    Names are case-insensitive, arguments are positional or keyword Python literals, ``+`` composes.
    Parsing uses :mod:`ast` and literal evaluation only; nothing is executed.
    """
    if not isinstance(spec, str):
        raise ValueError(f"A delay spec must be a string, got {type(spec).__name__}")
    if not spec.strip():
        raise ValueError("Empty delay spec; use 'none' for no delay")
    try:
        tree = ast.parse(spec.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"Cannot parse delay spec {spec!r}: {err.msg}") from None
    return _build(tree.body, spec)
