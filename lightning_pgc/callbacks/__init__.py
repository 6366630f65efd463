"""Callbacks that work with any strategy: the PGC diagnostics, the staleness valve, straggler and fault injection.

- :class:`PGCDiagnostics` (diagnostics.py): what the leader saw each step, logged under ``pgc/...`` (attached by
  :class:`~lightning_pgc.PGCStrategy` by default); its optional theory measurements are theory_metrics.py.
- :class:`StalenessValve` (valve.py): lowers the learning rate, or the bounded window, when the measured
  staleness term grows.
- :class:`StragglerInjector` (stragglers.py): sleeps on chosen ranks, identically under ``ddp`` and the PGC
  strategies, so comparisons are fair; the delay models it sleeps are :mod:`lightning_pgc.delays` (re-exported
  here, as they configure it).
- :class:`Stall`, :class:`Freeze`, :class:`Kill`, :class:`Terminate`, :class:`NaNGradient`,
  :class:`NaNBuffers` (faults.py): one fault at a chosen step.
"""

from lightning_pgc.callbacks.diagnostics import PGCDiagnostics
from lightning_pgc.callbacks.faults import Freeze, Kill, NaNBuffers, NaNGradient, Stall, Terminate
from lightning_pgc.callbacks.stragglers import StragglerInjector
from lightning_pgc.callbacks.valve import StalenessValve
from lightning_pgc.delays import Constant, DelayModel, Exponential, LogNormal, NoDelay, SlowRanks, Spikes, parse_delay

__all__ = [
    "Constant",
    "DelayModel",
    "Exponential",
    "Freeze",
    "Kill",
    "LogNormal",
    "NaNBuffers",
    "NaNGradient",
    "NoDelay",
    "PGCDiagnostics",
    "SlowRanks",
    "Spikes",
    "Stall",
    "StalenessValve",
    "StragglerInjector",
    "Terminate",
    "parse_delay",
]
