"""The control plane's wire format: a fixed schema per message kind, encoded as compact JSON, checked on receipt.

A message is a list of plain values: its kind (a string), then its fields, each an int, a float, a bool, a string,
a list of those, or None (the ``stop`` message's statistics). A rank's inbox carries ``[term, kind, fields...]``
(term -1: from the rank itself), the leader's box ``[kind, fields...]``; :data:`INBOX` and :data:`LEADER_BOX` name
every kind of each and the type and range of every field. Nothing else is ever read from the store: no pickle, so a
process that reaches the store can at worst send a message the schema admits, never run code on a rank.

:func:`decode` refuses (:class:`WireError`) anything that is not valid UTF-8 JSON of the right shape, a kind the
box does not carry, a wrong number of fields, a field of the wrong type, a rank outside ``[0, n)``, a negative or
absurd version, a plan entry for a later version than its decision or a key twice in a plan, or a message over
:data:`MAX_MESSAGE_BYTES`. The receiver drops such a message and logs it (:class:`DropLog`); it never ends a run.

Pure: no torch, no torch.distributed.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any, Callable, Optional

from lightning_pgc.decisions.leader import STAT_NAMES

__all__ = [
    "INBOX",
    "LEADER_BOX",
    "MAX_MESSAGE_BYTES",
    "DropLog",
    "WireError",
    "decode",
    "encode",
]

log = logging.getLogger(__name__)

#: The largest message read (a ``stop`` at n = 256 is about 30 kB; the store itself caps a value at 8 MiB).
MAX_MESSAGE_BYTES = 1 << 20
#: The largest version, count or term accepted: 2^53, where JSON's numbers stop being exact in most readers.
MAX_INT = 1 << 53
#: The longest string field (an ``abort``'s error text is cut to this on sending).
MAX_TEXT = 4096


class WireError(ValueError):
    """A control message that does not fit its schema; ``kind`` names its kind when that much was readable."""

    def __init__(self, reason: str, kind: str = "?") -> None:
        super().__init__(reason)
        self.kind = kind


#: A field's check: ``(value as read, world size) -> value as the runtime uses it``, or :class:`WireError`.
Field = Callable[[Any, int], Any]


def _int(value: Any, lo: int, hi: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{what} must be an integer, got {type(value).__name__}")
    if not lo <= value < hi:
        raise WireError(f"{what} {value} is outside [{lo}, {hi})")
    return value


def rank(value: Any, n: int) -> int:
    return _int(value, 0, n, "rank")


def rank_or_none(value: Any, n: int) -> int:
    """A rank, or -1 (a plan's partition that no rank covers)."""
    return _int(value, -1, n, "rank")


def version(value: Any, n: int) -> int:
    return _int(value, 0, MAX_INT, "version")


def count(value: Any, n: int) -> int:
    """A configuration, a collective's number, a count of skipped versions: non-negative."""
    return _int(value, 0, MAX_INT, "count")


def completed(value: Any, n: int) -> int:
    """The last version completed: -1 before the first."""
    return _int(value, -1, MAX_INT, "version")


def term(value: Any, n: int) -> int:
    """A leader's term; -1: a rank's message to itself."""
    return _int(value, -1, MAX_INT, "term")


def partition(value: Any, n: int) -> int:
    """A partition, or -1 (the scheme's round robin)."""
    return _int(value, -1, n, "partition")


def alive(value: Any, n: int) -> int:
    return _int(value, 0, n + 1, "live ranks")


def seconds(value: Any, n: int) -> float:
    """A finite number (a time, or -1: not measured)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise WireError(f"a time must be a finite number, got {value!r:.40}")
    return float(value)


def flag(value: Any, n: int) -> bool:
    if not isinstance(value, bool):
        raise WireError(f"a flag must be true or false, got {type(value).__name__}")
    return value


def text(value: Any, n: int) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise WireError(f"a text must be a string of at most {MAX_TEXT} characters")
    return value


def _list(value: Any, n: int, longest: int, item: Field, what: str) -> list[Any]:
    if not isinstance(value, list) or len(value) > longest:
        raise WireError(f"{what} must be a list of at most {longest} entries")
    return [item(v, n) for v in value]


def ages(value: Any, n: int) -> tuple[int, ...]:
    return tuple(_list(value, n, n, count, "ages"))


def members(value: Any, n: int) -> list[int]:
    out = _list(value, n, n, rank, "members")
    if out != sorted(set(out)) or not out:
        raise WireError("members must be distinct ranks in increasing order, at least one")
    return out


def notes(value: Any, n: int) -> tuple[int, ...]:
    return tuple(_list(value, n, n + 2, lambda v, m: _int(v, -MAX_INT, MAX_INT, "note"), "notes"))


def _entry(value: Any, n: int) -> Any:
    """A plan entry: a rank (its own code of the decided version), or ``[partition, rank or -1, version]``."""
    if isinstance(value, list):
        if len(value) != 3:
            raise WireError("a plan entry must be a rank or [partition, rank, version]")
        return (partition(value[0], n), rank_or_none(value[1], n), version(value[2], n))
    return rank(value, n)


def words(value: Any, n: int) -> Optional[list[float]]:
    """The leader's statistics: one number per rank and ``STAT_NAMES`` entry, or None."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != len(STAT_NAMES) * n:
        raise WireError(f"the statistics must be {len(STAT_NAMES)} numbers per rank")
    if any(isinstance(w, bool) or not isinstance(w, (int, float)) for w in value):
        raise WireError("the statistics must be numbers")
    return [float(w) for w in value]


def plan(value: Any, n: int) -> list[Any]:
    return _list(value, n, n, _entry, "a plan")


def _plan_sane(fields: tuple[Any, ...]) -> None:
    """``decide``: no plan entry is for a later version than the one decided, and no decode key comes twice."""
    if any(isinstance(e, tuple) and e[2] > fields[0] for e in fields[1]):
        raise WireError(f"the plan of version {fields[0]} names a code of a later version")
    keys = [e[0] if isinstance(e, tuple) else e for e in fields[1]]
    if len(set(keys)) != len(keys):
        raise WireError(f"the plan of version {fields[0]} names a rank or partition twice")


#: Every kind a box carries, with its fields' checks in order.
Schema = dict[str, tuple[Field, ...]]

#: The leader's box: what workers (and the leader's own heartbeat thread) send the leader of a term.
LEADER_BOX: Schema = {
    "code": (rank, version, ages, count, partition, seconds),  # rank, version, ages, skipped, partition, busy_s
    "beat": (rank, version),  # rank, the version its training thread is at
    "tick": (),  # the leader's own heartbeat thread
    "reject": (rank, version),
    "rejoin": (rank, version),
    "bye": (rank, count, flag),  # rank, skipped, leaving alone
    "report": (rank, count, completed),  # rank, configuration, last version completed
    "coll": (rank, count),  # rank, collective
    "halt": (),
}

#: A rank's inbox: what the leader sends (after the term), and the rank's own ``tick`` and ``halt`` (term -1).
INBOX: Schema = {
    "tick": (seconds,),  # sent at (monotonic seconds)
    "halt": (),
    "beat": (version, alive),  # the open version, live ranks
    "decide": (version, plan, notes),
    "detach": (version, rank),  # from version, rank
    "attach": (version, rank, rank, text),  # version, recipient, donor, transfer
    "query": (count,),  # configuration
    "conf": (count, members, version),  # configuration, members, from version
    "coll": (count,),
    "stop": (words,),
    "lead": (rank,),
    "abort": (text,),
}


#: Checks of several fields together, by kind (after each field's own).
_ACROSS: dict[str, Callable[[tuple[Any, ...]], None]] = {"decide": _plan_sane}


def _fields(schema: Schema, kind: str, fields: list[Any], n: int) -> tuple[Any, ...]:
    spec = schema[kind]
    if len(fields) != len(spec):
        raise WireError(f"{len(fields)} fields, the schema has {len(spec)}", kind)
    out = tuple(check(value, n) for check, value in zip(spec, fields))
    if kind in _ACROSS:
        _ACROSS[kind](out)
    return out


def encode(schema: Schema, message: tuple[Any, ...], framed: bool) -> bytes:
    """The bytes of ``message``: ``(kind, fields...)``, or with ``framed`` ``(term, (kind, fields...))``.

    Raises:
        WireError: a kind the schema does not name, or the wrong number of fields (a bug of the sender).
    """
    head, body = ([message[0]], message[1]) if framed else ([], message)
    kind = body[0]
    if kind not in schema or len(body) - 1 != len(schema[kind]):
        raise WireError(f"cannot send {body!r:.80}: not a message of the schema", str(kind))
    if kind == "abort":
        body = (kind, str(body[1])[:MAX_TEXT])
    return json.dumps([*head, *body], separators=(",", ":")).encode()


def decode(schema: Schema, data: bytes, n: int, framed: bool) -> tuple[Any, ...]:
    """The message ``data`` carries, checked against ``schema`` for ``n`` ranks: ``(kind, fields...)``, or with
    ``framed`` ``(term, (kind, fields...))``.

    Raises:
        WireError: ``data`` does not fit the schema (see the module's docstring).
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"{len(data)} bytes, more than {MAX_MESSAGE_BYTES}")
    try:
        items = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise WireError(f"not JSON: {exc}") from None
    if not isinstance(items, list) or len(items) < (2 if framed else 1):
        raise WireError("not a list with a kind")
    head = term(items[0], n) if framed else None
    kind = items[1 if framed else 0]
    if not isinstance(kind, str) or kind not in schema:
        raise WireError(f"unknown kind {kind!r:.40}")
    try:
        body = (kind, *_fields(schema, kind, items[2 if framed else 1 :], n))
    except WireError as exc:
        raise WireError(str(exc), kind) from None
    return (head, body) if framed else body


class DropLog:
    """Logs dropped messages: the first of each kind at once, then at most one line per kind every ``every``
    seconds, with how many were dropped meanwhile. ``dropped`` counts them all."""

    def __init__(self, where: str, every: float = 60.0) -> None:
        self.where = where
        self.every = every
        self.dropped = 0
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def drop(self, box: str, error: WireError) -> None:
        self.dropped += 1
        kind = error.kind
        self._since[kind] = self._since.get(kind, 0) + 1
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.every:
            return
        log.warning(
            "PGC %s: dropped %d malformed control message(s) of kind %r in %s (%s); is something other than this "
            "job writing to its store?",
            self.where,
            self._since[kind],
            kind,
            box,
            error,
        )
        self._last[kind] = now
        self._since[kind] = 0
