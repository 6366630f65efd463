"""``pgc_auto`` in the emulator: the strategy's own leader and switching rule
(:class:`~lightning_pgc.decisions.auto_leader.AutoLeader`, :class:`~lightning_pgc.decisions.auto.AutoRule`) on the
simulated clock.

:func:`~lightning_pgc.emulator.clock.simulate` drives the leader :func:`auto_leader` builds whenever its scheme is an
:class:`~lightning_pgc.codes.AutoScheme` (the map's arm ``pgc_auto``, registered in
:data:`lightning_pgc.emulator.cells.STRATEGIES`): each simulated code's header carries the rank's busy seconds, as
a real rank's announcement carries its own time, and the all-reduce takes the clock's ``aggregate_s``. Not modelled:
heartbeats (the simulated leader never judges a rank silent, so the ``dgd`` arm waits for every rank).
"""

from __future__ import annotations

import math
from typing import Optional

from lightning_pgc.codes import AutoScheme
from lightning_pgc.decisions.auto import AutoRule, FactorTable, candidates
from lightning_pgc.decisions.auto_leader import AutoLeader, Switch

__all__ = ["auto_leader", "switches"]


def auto_leader(
    scheme: AutoScheme, steps: int, aggregate_s: float = 0.0, rule: Optional[AutoRule] = None
) -> AutoLeader:
    """The leader a simulated ``pgc_auto`` run drives: the strategy's defaults (``max_stragglers`` = ``scheme.s``,
    the shipped factor table's entry nearest ``n``), liveness never judged, every record kept."""
    if rule is None:
        rule = AutoRule(scheme.n, candidates(scheme.s), FactorTable.shipped(scheme.n))
    return AutoLeader(
        scheme,
        scheme.n,
        0,
        timeout=math.inf,
        max_lag=1 << 30,
        heartbeat_window=math.inf,
        keep_records=max(steps + 1, 16),
        now=0.0,
        rule=rule,
        allreduce_s=aggregate_s,
    )


def switches(leader: AutoLeader) -> list[Switch]:
    """The switches a simulated run made, in order."""
    return list(leader.switches)
