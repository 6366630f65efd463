"""The leader of ``scheme="auto"``: the runtime's admission and liveness, with the arm chosen by
:class:`~lightning_pgc.decisions.auto.AutoRule` from the step times the codes' announcements carry (no I/O)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Optional

from lightning_pgc.codes import AutoScheme, Scheme
from lightning_pgc.decisions.auto import DGD, AutoCandidate, AutoRule, Decision, FactorTable, candidates
from lightning_pgc.decisions.header import Header
from lightning_pgc.decisions.leader import Leader, StepRecord

__all__ = ["AutoLeader", "Switch"]


class Switch:
    """One switch: from ``version`` on the aggregates run ``new`` instead of ``old``; ``reason`` is the log line."""

    def __init__(self, version: int, old: AutoCandidate, new: AutoCandidate, reason: str) -> None:
        self.version, self.old, self.new, self.reason = version, old, new, reason

    def __repr__(self) -> str:
        return f"Switch(version={self.version}, {self.old.label} -> {self.new.label})"


class AutoLeader(Leader):
    """A :class:`~lightning_pgc.decisions.leader.Leader` whose closing rule is the current arm's.

    Under an arm with ``s`` the open version closes once ``n - s`` codes arrived, or, with at least ``n -
    max_stragglers``, once every rank that could still send one has (the others are dead, finished, detached,
    silent for a heartbeat window or rejected their gradient): so ``dgd`` waits for every live rank and a fault
    is survived as under ``ignore`` with ``max_stragglers``. The aggregate averages the admitted codes (the
    scheme's decode), which under ``dgd`` is ddp's mean. After each close the rule decides the next version's arm;
    :meth:`arm_of` tells which arm closed a version (what the decision message carries to every rank).

    Args:
        rule: the switching rule (default: :class:`AutoRule` over ``dgd`` and ``ignore`` with ``s = 1 ..
            max_stragglers``, the shipped factor table's entry nearest ``n``).
        state: the rule's saved state to continue from (a resumed run), or just ``{"arm": [scheme, s]}`` (a
            successor leader: it keeps the arm in effect and gathers its evidence afresh).
        allreduce_s: the all-reduce time to assume until one is measured (:meth:`on_allreduce`).
    """

    def __init__(
        self,
        scheme: Scheme,
        world_size: int,
        start_version: int,
        timeout: float,
        max_lag: int,
        heartbeat_window: float = 3.0,
        keep_records: int = 4096,
        now: Optional[float] = None,
        *,
        rule: Optional[AutoRule] = None,
        state: Optional[dict[str, Any]] = None,
        allreduce_s: float = 0.0,
        on_switch: Optional[Callable[[Switch], None]] = None,
    ) -> None:
        if not isinstance(scheme, AutoScheme):
            raise TypeError(f"AutoLeader needs an AutoScheme, got {type(scheme).__name__}")
        super().__init__(scheme, world_size, start_version, timeout, max_lag, heartbeat_window, keep_records, now)
        if rule is None:
            rule = AutoRule(world_size, candidates(scheme.s), FactorTable.shipped(world_size))
        self.rule = rule
        if state is not None:
            self.rule.load_state_dict(state)
        if allreduce_s > 0 and not self.rule.window.allreduce:
            self.rule.window.add_allreduce(allreduce_s)
        self.switches: list[Switch] = []
        self.on_switch = on_switch
        self._arms: deque[tuple[int, AutoCandidate]] = deque(maxlen=keep_records)
        self._rule_lock = threading.Lock()  # the rule's state is read by a checkpoint on another thread

    @property
    def arm(self) -> AutoCandidate:
        """The arm the open version closes under."""
        return self.rule.arm

    def on_code(self, header: Header, arrived: float) -> None:
        super().on_code(header, arrived)
        if header.busy_s >= 0:
            with self._rule_lock:
                self.rule.add(header.sender, header.version, header.busy_s)

    def on_allreduce(self, seconds: float) -> None:
        """An all-reduce of the data group took ``seconds`` (measured on the leader's rank)."""
        with self._rule_lock:
            self.rule.window.add_allreduce(seconds)

    def _nobody_else(self, now: float) -> bool:
        """Whether every rank without a code for the open version cannot send one now."""
        rejected = self._rejected.get(self.version, set())
        arrived = set(self._order)
        return all(
            r in arrived
            or r in self.dead
            or r in self.byes
            or r in self.detached
            or r in rejected
            or not self.is_alive(r, now)
            for r in range(self.world_size)
        )

    def try_close(self, now: float) -> Optional[StepRecord]:
        order = self._order
        if not order or not self.scheme.admits(order):
            return None
        if len(order) < self.world_size - self.arm.s and not self._nobody_else(now):
            return None
        arm = self.arm
        rec = super().try_close(now)
        if rec is None:
            return None
        self._arms.append((rec.version, arm))
        with self._rule_lock:
            decision: Decision = self.rule.step(rec.version)
        if decision.switched:
            switch = Switch(rec.version + 1, arm, decision.arm, decision.reason)
            self.switches.append(switch)
            if self.on_switch is not None:
                self.on_switch(switch)
        return rec

    def arm_of(self, version: int) -> AutoCandidate:
        """The arm that closed ``version`` (``dgd`` if no longer kept)."""
        for v, arm in reversed(self._arms):
            if v == version:
                return arm
            if v < version:
                break
        return DGD

    def notes(self, version: int) -> tuple[int, int]:
        """What the decision message of ``version`` carries to every rank: ``(arm code, s)`` of the arm that closed it
        (:func:`~lightning_pgc.decisions.auto.arm_from_code` reads it back)."""
        arm = self.arm_of(version)
        return (arm.code, arm.s)

    def state_dict(self) -> dict[str, Any]:
        """The rule's state (the arm, the recent times, the stalls and the evidence): what a checkpoint keeps."""
        with self._rule_lock:
            return self.rule.state_dict()
