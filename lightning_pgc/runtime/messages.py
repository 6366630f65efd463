"""Wire format of the PGC streams.

Data messages (codes and aggregate shards) are one flat tensor: a small int64 header reinterpreted (not
converted) into the payload dtype, followed by one shard of the payload, so integers survive bit-exactly and one
``send`` carries both. Control messages (the leader's decisions) are small int64 vectors.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

import torch
from torch import Tensor


class Kind(IntEnum):
    """What a message carries."""

    CODE = 0  # worker -> shard owner: one shard of an encoded gradient for one version
    AGGREGATE = 1  # shard owner -> every rank: one shard of the decoded aggregate of one version
    BYE = 2  # the sender sends nothing more on this stream
    ABORT = 3  # leader -> every rank: the leader failed; stop training (payload: the error text)
    DECIDE = 4  # leader -> shard owners: version ``version`` closes with these ranks, in this order
    ASSIGN = 5  # leader -> every rank: shard ``a`` is owned by rank ``b`` from version ``version`` on
    STOP = 6  # leader -> every rank: every rank said BYE; ``version`` is the first version never opened
    BEAT = 7  # heartbeat: worker -> leader (``version``: the version its training thread is at), leader -> every rank
    REJECT = 8  # worker -> leader: its code for ``version`` was not finite and was not sent
    DETACH = 9  # leader -> every rank: no aggregates to rank ``a`` from ``version`` on (it fell too far behind)
    REJOIN = 10  # worker -> leader: rank ``sender`` is back at ``version`` and needs the current state
    ATTACH = 11  # leader -> every rank: rank ``a`` gets aggregates again from ``version`` on; rank ``b`` donates
    LOST = 12  # worker -> leader: the aggregate stream of dead owner ``a`` broke; the last version of its shard ``b``
    # that arrived here is ``version``
    QUERY = 13  # leader -> every rank: owner ``a`` is frozen: accept no more of its shards and answer with LOST
    DEPOSE = 14  # successor -> a leader that froze: rank ``a`` leads now; go on as a worker (it rejoins)


HEADER_FIELDS = 11  # kind, version, sender, shard, valid entries, max age, packed ages, skipped, partition, table
# (the table takes two words: its length and the packed ages)
AGE_SLOTS = 16  # ages of the first 16 cache entries, 4 bits each, clamped at 15
CONTROL_FIELDS = 4  # kind, version, a, b
STAT_FIELDS = 6  # per rank in a STOP: admitted, late, skipped, mean lag, rejected, rejoined (float64 bits)


@dataclass(frozen=True)
class Header:
    """Decoded header of a data message; ``ages`` are the ages (in versions) of the cache entries a code used.

    In an aggregate's shard 0, ``valid`` is how many ranks rejoin at this version (each needs the state from a
    donor, named in the leader's ``ATTACH`` messages; see :class:`~lightning_pgc.runtime.worker.PGCRuntime`).
    Bounded staleness: a code's ``partition`` is the partition it carries (-1: the scheme's round robin); an
    aggregate's ``table`` is ``t - v_i`` of every partition's entry the version closed with (at most 16, clamped
    at 15), which workers read to pick their next partition (``choice="oldest"``).
    """

    kind: Kind
    version: int
    sender: int
    shard: int = 0
    valid: int = 0
    max_age: int = 0
    ages: tuple[int, ...] = ()
    skipped: int = 0  # versions the sender applied without computing so far (for rank statistics)
    partition: int = -1
    table: tuple[int, ...] = ()


def pack_ages(ages: Sequence[int]) -> int:
    """Ages as 4-bit nibbles in one int64 (first 16 entries, each clamped at 15)."""
    word = 0
    for i, a in enumerate(tuple(ages)[:AGE_SLOTS]):
        word |= min(max(int(a), 0), 15) << (4 * i)
    return word - (1 << 64) if word >= (1 << 63) else word


def unpack_ages(word: int, count: int) -> tuple[int, ...]:
    word &= (1 << 64) - 1
    return tuple((word >> (4 * i)) & 15 for i in range(min(count, AGE_SLOTS)))


def header_numel(dtype: torch.dtype) -> int:
    """Number of payload-dtype elements the packed header occupies."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if 8 % itemsize:
        raise ValueError(f"unsupported payload dtype {dtype}")
    return HEADER_FIELDS * 8 // itemsize


def message_numel(shard_numel: int, dtype: torch.dtype) -> int:
    """Total elements of a data message carrying one shard of ``shard_numel`` elements."""
    return header_numel(dtype) + shard_numel


def header_words(header: Header) -> list[int]:
    return [
        int(header.kind),
        header.version,
        header.sender,
        header.shard,
        header.valid,
        header.max_age,
        pack_ages(header.ages),
        header.skipped,
        header.partition + 1,
        len(header.table),
        pack_ages(header.table),
    ]


def write_header(message: Tensor, header: Header) -> None:
    """Write ``header`` into the first elements of ``message`` (a contiguous 1-D data message), in place."""
    hn = header_numel(message.dtype)
    message[:hn].view(torch.int64).copy_(torch.tensor(header_words(header), dtype=torch.int64))


def read_header(message: Tensor) -> Header:
    h = message[: header_numel(message.dtype)].view(torch.int64).tolist()
    return Header(
        Kind(h[0]), h[1], h[2], h[3], h[4], h[5], unpack_ages(h[6], h[4]), h[7], h[8] - 1, unpack_ages(h[10], h[9])
    )


def pack(header: Header, payload: Tensor | None, shard_numel: int, dtype: torch.dtype) -> Tensor:
    """A new data message: ``header`` followed by ``payload`` (zeros when None). For control paths and tests;
    the hot path writes headers into preallocated messages with :func:`write_header`."""
    out = torch.zeros(message_numel(shard_numel, dtype), dtype=dtype)
    write_header(out, header)
    if payload is not None:
        out[header_numel(dtype) :] = payload.reshape(-1).to(dtype)
    return out


def unpack(message: Tensor) -> tuple[Header, Tensor]:
    """Split a data message into its header and a view of its payload."""
    return read_header(message), message[header_numel(message.dtype) :]


def text_payload(text: str, payload_numel: int, dtype: torch.dtype) -> Tensor:
    """Carry a (truncated) UTF-8 text in a payload, e.g. the leader's error for an ABORT."""
    size = payload_numel * torch.empty((), dtype=dtype).element_size()
    raw = text.encode("utf-8", errors="replace")[:size].ljust(size, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)


def payload_text(payload: Tensor) -> str:
    """Inverse of :func:`text_payload`."""
    return payload.contiguous().view(torch.uint8).numpy().tobytes().rstrip(b"\0").decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------------ control plane
def control_numel(world_size: int) -> int:
    """int64 words of a control message: a fixed prefix, then room for ``STAT_FIELDS`` words per rank."""
    return CONTROL_FIELDS + STAT_FIELDS * world_size


def control(
    world_size: int, kind: Kind, version: int, a: int = 0, b: int = 0, data: Sequence[int] | Tensor = ()
) -> Tensor:
    """A control message: ``kind``, ``version``, two small integers and up to ``4 n`` data words."""
    out = torch.zeros(control_numel(world_size), dtype=torch.int64)
    out[:CONTROL_FIELDS] = torch.tensor([int(kind), version, a, b], dtype=torch.int64)
    if len(data):
        words = data if isinstance(data, Tensor) else torch.tensor(list(data), dtype=torch.int64)
        out[CONTROL_FIELDS : CONTROL_FIELDS + len(words)] = words
    return out


def read_control(message: Tensor) -> tuple[Kind, int, int, int, Tensor]:
    """``(kind, version, a, b, data)`` of a control message (``data`` is a view)."""
    kind, version, a, b = message[:CONTROL_FIELDS].tolist()
    return Kind(kind), version, a, b, message[CONTROL_FIELDS:]


def decide_words(version: int, plan: Sequence[tuple[int, int, int]]) -> tuple[int, int, list[int]]:
    """``(a, b, data)`` of a DECIDE for ``plan``, the ``(decode key, rank, code version)`` of every code used.

    ``b = 0``: every code is the rank's own for ``version`` (key = rank; data = the ranks). ``b = 1``: bounded
    staleness, key ``i`` = partition ``i`` (data = the ranks, then their code versions).
    """
    if all(key == rank and v == version for key, rank, v in plan):
        return len(plan), 0, [rank for _, rank, _ in plan]
    if [key for key, _, _ in plan] != list(range(len(plan))):
        raise ValueError(f"a DECIDE with code versions needs keys 0..{len(plan) - 1}, got {plan}")
    return len(plan), 1, [rank for _, rank, _ in plan] + [v for _, _, v in plan]


def read_decide(version: int, a: int, b: int, data: Tensor) -> list[tuple[int, int, int]]:
    """Inverse of :func:`decide_words`."""
    words = data[: a * (1 + b)].tolist()
    if b == 0:
        return [(k, k, version) for k in words]
    return [(i, words[i], words[a + i]) for i in range(a)]
