"""lightning_pgc: straggler-tolerant data-parallel training for PyTorch Lightning (pipelined gradient coding).

Importing the package registers the strategy names ``pgc``, ``pgc_cr``, ``pgc_fr``, ``gc_cr``, ``gc_fr``,
``ignore_stragglers``, ``dgd``, ``pgc_auto`` and ``bounded_staleness`` in Lightning's ``StrategyRegistry``, so
``Trainer(strategy="pgc")`` works. ``pgc`` is ``pgc_cr`` with the look-ahead staleness correction; ``pgc_cr`` is
uncorrected. ``PGCStrategy``'s option groups (``CodingOptions``, ``CoordinatorOptions``, ``AutoOptions``,
``LivenessOptions``, ``DiagnosticsOptions``) are plain dataclasses, also taken as dicts.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pgc.callbacks import (
    Constant,
    DelayModel,
    Exponential,
    LogNormal,
    NoDelay,
    PGCDiagnostics,
    SlowRanks,
    Spikes,
    StalenessValve,
    StragglerInjector,
    parse_delay,
)
from lightning_pgc.codes import SCHEMES, Scheme, make_scheme
from lightning_pgc.strategy.preflight import PGCUnsupportedError
from lightning_pgc.strategy import PGCStrategy
from lightning_pgc.strategy.options import (
    AutoOptions,
    CodingOptions,
    CoordinatorOptions,
    DiagnosticsOptions,
    LivenessOptions,
)

__version__ = "0.1.0"

PGCStrategy.register_strategies(StrategyRegistry)  # skips names already registered (re-imports)

__all__ = [
    "AutoOptions",
    "CodingOptions",
    "Constant",
    "CoordinatorOptions",
    "DelayModel",
    "DiagnosticsOptions",
    "Exponential",
    "LivenessOptions",
    "LogNormal",
    "NoDelay",
    "PGCDiagnostics",
    "PGCStrategy",
    "PGCUnsupportedError",
    "SCHEMES",
    "Scheme",
    "SlowRanks",
    "Spikes",
    "StalenessValve",
    "StragglerInjector",
    "make_scheme",
    "parse_delay",
]
