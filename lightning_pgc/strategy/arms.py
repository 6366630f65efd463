"""ArmLog: under ``scheme="auto"``, which arm each version this rank applied ran, the switches, and the leader's
rule carried across a checkpoint and a change of leader."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Protocol

from lightning_pgc.codes import Scheme
from lightning_pgc.decisions.auto import DGD, AutoCandidate, AutoRule, FactorTable, arm_from_code, candidates
from lightning_pgc.decisions.auto_leader import AutoLeader, Switch
from lightning_pgc.runtime.plane import CollectiveRuntime
from lightning_pgc.strategy.options import AutoOptions

log = logging.getLogger("lightning_pgc.strategy")
#: the switches' log: shown at INFO by default, as Lightning shows its own INFO lines (a handler of its own when the
#: root logger has none); ``logging.getLogger("lightning_pgc.auto").setLevel(logging.WARNING)`` silences it
switch_log = logging.getLogger("lightning_pgc.auto")
if switch_log.level == logging.NOTSET:
    switch_log.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers() and not switch_log.handlers:
    switch_log.addHandler(logging.StreamHandler())


class ArmLogHost(Protocol):
    """What :class:`ArmLog` reads of its strategy (:class:`~lightning_pgc.PGCStrategy`)."""

    @property
    def global_rank(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def auto(self) -> AutoOptions: ...

    @property
    def runtime(self) -> Optional[CollectiveRuntime]: ...


class ArmLog:
    """What one rank knows of ``scheme="auto"``'s arms: the arm of each version it applied (from the decision
    messages, so every rank sees a switch at the same version) and the switches, in order."""

    def __init__(self, strategy: ArmLogHost) -> None:
        self.strategy = strategy
        self.arm: AutoCandidate = DGD
        # (first version under the new arm, old, new)
        self.switches: list[tuple[int, AutoCandidate, AutoCandidate]] = []
        self._last_version = -1

    def reset(self, arm: AutoCandidate = DGD) -> None:
        self.arm, self.switches, self._last_version = arm, [], -1

    def applied(self, version: int, notes: Optional[tuple[int, ...]]) -> None:
        """This rank applied ``version``, whose decision message carried ``notes`` (``(arm code, s)``)."""
        if not notes or len(notes) != 2 or version <= self._last_version:
            return
        self._last_version = version
        arm = arm_from_code(int(notes[0]), int(notes[1]))
        if arm != self.arm:
            self.switches.append((version, self.arm, arm))
            log.debug("PGC rank %d: version %d runs %s", self.strategy.global_rank, version, arm.label)
            self.arm = arm

    def leader_factory(self, saved: Optional[dict[str, Any]]) -> Callable[..., AutoLeader]:
        """How this rank builds its leader: the first one continues a checkpoint's rule (``saved``: the checkpoint's
        ``pgc`` entry) or starts as ``dgd``; a successor keeps the arm this rank last applied and gathers its
        evidence afresh (the old leader's died with it)."""
        state = (saved or {}).get("auto")
        self.reset(DGD if state is None else AutoCandidate(str(state["arm"][0]), int(state["arm"][1])))
        options = self.strategy.auto

        def make(
            scheme: Scheme, world_size: int, version: int, timeout: float, max_lag: int, heartbeat_window: float
        ) -> AutoLeader:
            rule = AutoRule(
                world_size,
                candidates(options.max_stragglers),
                FactorTable.shipped(world_size),
                margin=options.margin,
                threshold=options.threshold,
                horizon=options.horizon,
            )
            first = self._last_version < 0  # the fit's first leader (else a successor: this rank applied versions)
            if rule.left_out and first:
                log.info(
                    "PGC auto: no versions-to-target factor for %s with n=%d in the shipped table: not candidates",
                    ", ".join(a.label for a in rule.left_out),
                    world_size,
                )
            start = state if first and state is not None else {"arm": [self.arm.scheme, self.arm.s]}
            return AutoLeader(
                scheme,
                world_size,
                version,
                timeout,
                max_lag,
                heartbeat_window,
                rule=rule,
                state=start,
                on_switch=_log_switch,
            )

        return make

    def save(self, checkpoint: dict[str, Any]) -> None:
        """The rank that writes Lightning's checkpoint, if it leads: the rule's state into its ``pgc`` entry."""
        runtime = self.strategy.runtime
        leader = None if runtime is None else runtime.leader
        if isinstance(leader, AutoLeader) and self.strategy.is_global_zero:
            checkpoint.setdefault("pgc", {})["auto"] = leader.state_dict()


def _log_switch(switch: Switch) -> None:
    switch_log.info("PGC auto, from version %d: %s", switch.version, switch.reason)
