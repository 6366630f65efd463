"""The control plane's wire format: every kind round-trips, anything malformed is refused, and on a real store a
malformed message (of every kind, garbage, a pickle) is dropped and logged while the runtime goes on."""

from __future__ import annotations

import json
import logging
import os
import pickle
import time

import pytest
import torch

from lightning_pgc.codes import make_scheme
from lightning_pgc.runtime.control import Channel, inbox, leader_box, term_key
from lightning_pgc.runtime.wire import INBOX, LEADER_BOX, MAX_MESSAGE_BYTES, WireError, decode, encode
from tests.test_dataplane import _planes, _stop_all, _submit

N = 4

#: One message of every kind, as its sender builds it (and as the receiver reads it back).
LEADER_MESSAGES = {
    "code": ("code", 3, 12, (0, 1), 2, -1, 0.0125),
    "beat": ("beat", 1, 12),
    "tick": ("tick",),
    "reject": ("reject", 2, 12),
    "rejoin": ("rejoin", 3, 9),
    "bye": ("bye", 1, 4, True),
    "report": ("report", 2, 1, -1),
    "coll": ("coll", 0, 7),
    "halt": ("halt",),
}
INBOX_MESSAGES = {
    "tick": (-1, ("tick", 1234.5678901)),
    "halt": (-1, ("halt",)),
    "beat": (0, ("beat", 12, 3)),
    "decide": (0, ("decide", 12, [0, 2, 3], ())),
    "detach": (1, ("detach", 12, 3)),
    "attach": (0, ("attach", 13, 3, 0, "0.1")),
    "query": (0, ("query", 2)),
    "conf": (0, ("conf", 3, [0, 1, 3], 13)),
    "coll": (0, ("coll", 7)),
    "stop": (0, ("stop", [float(i) for i in range(6 * N)])),
    "lead": (2, ("lead", 2)),
    "abort": (0, ("abort", "CoordinatorError: no member answered")),
}


def test_every_kind_has_an_example_here():
    assert set(LEADER_MESSAGES) == set(LEADER_BOX) and set(INBOX_MESSAGES) == set(INBOX)


@pytest.mark.parametrize("kind", sorted(LEADER_MESSAGES))
def test_every_leader_box_kind_round_trips(kind):
    message = LEADER_MESSAGES[kind]
    assert decode(LEADER_BOX, encode(LEADER_BOX, message, False), N, False) == message


@pytest.mark.parametrize("kind", sorted(INBOX_MESSAGES))
def test_every_inbox_kind_round_trips(kind):
    message = INBOX_MESSAGES[kind]
    assert decode(INBOX, encode(INBOX, message, True), N, True) == message


def test_plans_floats_and_none_round_trip_exactly():
    bounded = (0, ("decide", 12, [(0, 3, 11), (1, -1, 12), (2, 2, 12), (3, 0, 10)], (1, 4, 0, 2)))
    assert decode(INBOX, encode(INBOX, bounded, True), N, True) == bounded
    no_stats = (0, ("stop", None))
    assert decode(INBOX, encode(INBOX, no_stats, True), N, True) == no_stats
    odd = (-1, ("tick", time.monotonic() / 3))
    assert decode(INBOX, encode(INBOX, odd, True), N, True) == odd  # (JSON keeps every bit of a double)


def test_a_message_the_schema_lacks_is_refused_on_sending():
    with pytest.raises(WireError, match="not a message of the schema"):
        encode(LEADER_BOX, ("code", 1, 2), False)
    with pytest.raises(WireError, match="not a message of the schema"):
        encode(INBOX, (0, ("hello",)), True)


def _leader(items) -> bytes:
    return json.dumps(items).encode()


#: Malformed leader-box messages, each with the kind its drop is logged under.
BAD_LEADER = [
    (_leader(["code", 3, 12, [0, 1], 2, -1]), "code"),  # a field missing
    (_leader(["code", 4, 12, [0], 0, -1, 0.1]), "code"),  # rank out of range
    (_leader(["code", 1, -3, [0], 0, -1, 0.1]), "code"),  # negative version
    (_leader(["code", 1, 3, [0, "x"], 0, -1, 0.1]), "code"),  # an age that is not a number
    (_leader(["code", 1, 3, [0], 0, 7, 0.1]), "code"),  # partition out of range
    (_leader(["code", 1, 3, [0], 0, -1, "NaN"]), "code"),  # a time that is a string
    (_leader(["beat", True, 3]), "beat"),  # a bool for a rank
    (_leader(["beat", 1, 3.5]), "beat"),  # a float for a version
    (_leader(["tick", 1]), "tick"),
    (_leader(["reject", -1, 3]), "reject"),
    (_leader(["rejoin", 1]), "rejoin"),
    (_leader(["bye", 1, 0, 1]), "bye"),  # an int for a flag
    (_leader(["report", 1, 0, -2]), "report"),
    (_leader(["coll", 9, 1]), "coll"),
    (_leader(["halt", "now"]), "halt"),
    (_leader(["decide", 3, [0], []]), "?"),  # an inbox kind in the leader's box
    (_leader(["exec", "rm -rf /"]), "?"),
    (_leader([]), "?"),
    (_leader({"kind": "code"}), "?"),
    (b"\xff\xfe garbage", "?"),
    (b"[" * 100000, "?"),  # nested past the parser's recursion limit
    (b'["beat", 1, ' + b"9" * 5000 + b"]", "?"),  # an integer past Python's digit limit
    (pickle.dumps(("beat", 1, 3)), "?"),
]

#: Malformed inbox messages.
BAD_INBOX = [
    (_leader([0, "tick"]), "tick"),
    (_leader([-1, "tick", float("inf")]), "tick"),
    (_leader([0, "halt", 0]), "halt"),
    (_leader([0, "beat", 12, N + 1]), "beat"),  # more live ranks than ranks
    (_leader([0, "decide", 12, [0, 4], []]), "decide"),  # a rank out of range
    (_leader([0, "decide", 12, [[0, 1, 13]], []]), "decide"),  # a code of a later version
    (_leader([0, "decide", 12, [[0, 1]], []]), "decide"),  # an entry of the wrong length
    (_leader([0, "decide", 12, [2, 2], []]), "decide"),  # a rank twice
    (_leader([0, "decide", 12, [[1, 0, 12], [1, 2, 12]], []]), "decide"),  # a partition twice
    (_leader([0, "decide", 12, list(range(N)) + [0], []]), "decide"),  # longer than n
    (_leader([0, "detach", 12]), "detach"),
    (_leader([0, "attach", 12, 1, 9, "0.1"]), "attach"),  # donor out of range
    (_leader([0, "attach", 12, 1, 0, 7]), "attach"),  # transfer not a string
    (_leader([0, "query", "1"]), "query"),
    (_leader([0, "conf", 2, [3, 1], 12]), "conf"),  # members out of order
    (_leader([0, "conf", 2, [], 12]), "conf"),  # nobody
    (_leader([0, "coll", -1]), "coll"),
    (_leader([0, "stop", [1.0, 2.0]]), "stop"),  # statistics of the wrong length
    (_leader([0, "lead", N]), "lead"),
    (_leader([0, "abort", "x" * 5000]), "abort"),
    (_leader([-2, "beat", 12, 3]), "?"),  # a term below -1
    (_leader(["beat", 12, 3]), "?"),  # no term
    (_leader([0, "code", 1, 2, [0], 0, -1, 0.0]), "?"),  # a leader-box kind in an inbox
    (b"\x80\x05K\x01.", "?"),
]


@pytest.mark.parametrize(("data", "kind"), BAD_LEADER)
def test_a_malformed_leader_box_message_is_refused_naming_its_kind(data, kind):
    with pytest.raises(WireError) as err:
        decode(LEADER_BOX, data, N, False)
    assert err.value.kind == kind


@pytest.mark.parametrize(("data", "kind"), BAD_INBOX)
def test_a_malformed_inbox_message_is_refused_naming_its_kind(data, kind):
    with pytest.raises(WireError) as err:
        decode(INBOX, data, N, True)
    assert err.value.kind == kind


def test_an_oversized_message_is_refused_unread():
    with pytest.raises(WireError, match="more than"):
        decode(INBOX, b" " * (MAX_MESSAGE_BYTES + 1), N, True)


class _Plant:
    """A pickle that creates a file when it is unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_on_a_real_store_every_malformed_message_is_dropped_and_logged_and_the_runtime_goes_on(tmp_path, caplog):
    """4 ranks on a real store and gloo groups (threads of this process). Before each version, every malformed
    message above lands in every rank's inbox and in the leader's box, with a code announcement for a version not
    open yet, a pickle that would create a file if anything unpickled it, and a term key that holds no rank. Every
    version still closes, every rank gets the same bits, nothing is unpickled, and each kind's drop is logged."""
    scheme = make_scheme("pgc_cr", N, 1)
    rts = _planes(scheme)
    planted = tmp_path / "planted"
    caplog.set_level(logging.WARNING, logger="lightning_pgc.runtime.wire")
    try:
        raw = rts[0].store.clone()
        key = f"{rts[0].prefix}/"
        trap = pickle.dumps(_Plant(str(planted)))
        future = _leader(["code", 1, 99, [0], 0, -1, 0.1])
        for v in range(3):
            for data, _ in BAD_LEADER + [(trap, "?"), (future, "code")]:
                raw.queue_push(key + leader_box(0), data)
            for rank in range(N):
                for data, _ in BAD_INBOX + [(trap, "?")]:
                    raw.queue_push(key + inbox(rank), data)
            for rt in rts:
                _submit(rt, v)
            aggs = [rt.wait(v) for rt in rts]
            assert all(torch.equal(a, aggs[0]) for a in aggs)
            for rt, agg in zip(rts, aggs):
                rt.release(agg)
        raw.set(key + term_key(1), "\x00not a rank")
        assert Channel(rts[0].store, rts[0].prefix, N).read(term_key(1)) is None
        assert all(rt.failure() is None for rt in rts)
        dropped = sum(c.drops.dropped for rt in rts for c in rt._channels)
        # every planted message that does not fit the schema, and nothing else (the early code fits: the leader drops it)
        assert dropped == 3 * (len(BAD_LEADER) + 1 + N * (len(BAD_INBOX) + 1))
    finally:
        _stop_all(rts)
    assert not planted.exists()
    logged = caplog.text
    for _, kind in BAD_LEADER + BAD_INBOX + [(None, "lead")]:
        assert f"of kind {kind!r}" in logged, kind
    assert "rank 1's code for version 99 while version" in logged
