"""Wire format of the PGC streams: a small int64 header packed in front of a flat payload.

The header is reinterpreted (not converted) to the payload dtype, so integers survive bit-exactly and one
``send`` carries header and payload together.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor


class Kind(IntEnum):
    """What a message carries."""

    CODE = 0  # worker -> coordinator: an encoded gradient for one version
    AGGREGATE = 1  # coordinator -> worker: the decoded aggregate of one version
    BYE = 2  # either direction: the sender sends nothing more on this stream
    ABORT = 3  # coordinator -> worker: the coordinator failed; stop training


HEADER_FIELDS = 6  # kind, version, sender, valid entries, max age, packed ages
AGE_SLOTS = 16  # ages of the first 16 cache entries, 4 bits each, clamped at 15


@dataclass(frozen=True)
class Header:
    """Decoded message header; ``ages`` are the ages (in versions) of the cache entries a code was built from."""

    kind: Kind
    version: int
    sender: int
    valid: int = 0
    max_age: int = 0
    ages: tuple[int, ...] = ()


def pack_ages(ages: tuple[int, ...]) -> int:
    """Ages as 4-bit nibbles in one int64 (first 16 entries, each clamped at 15)."""
    word = 0
    for i, a in enumerate(ages[:AGE_SLOTS]):
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


def message_numel(payload_numel: int, dtype: torch.dtype) -> int:
    """Total elements of a message with a payload of ``payload_numel`` elements."""
    return header_numel(dtype) + payload_numel


def pack(header: Header, payload: Tensor | None, payload_numel: int, dtype: torch.dtype) -> Tensor:
    """One flat tensor: header bits followed by the payload (zeros when ``payload`` is None)."""
    fields = [int(header.kind), header.version, header.sender, header.valid, header.max_age, pack_ages(header.ages)]
    h = torch.tensor(fields, dtype=torch.int64)
    out = torch.zeros(message_numel(payload_numel, dtype), dtype=dtype)
    hn = header_numel(dtype)
    out[:hn] = h.view(dtype)
    if payload is not None:
        out[hn:] = payload.reshape(-1).to(dtype)
    return out


def unpack(message: Tensor) -> tuple[Header, Tensor]:
    """Split a message into its header and a view of its payload."""
    hn = header_numel(message.dtype)
    h = message[:hn].contiguous().view(torch.int64).tolist()
    return Header(Kind(h[0]), h[1], h[2], h[3], h[4], unpack_ages(h[5], h[3])), message[hn:]


def text_payload(text: str, payload_numel: int, dtype: torch.dtype) -> Tensor:
    """Carry a (truncated) UTF-8 text in a payload, e.g. the coordinator's error for an ABORT."""
    size = payload_numel * torch.empty((), dtype=dtype).element_size()
    raw = text.encode("utf-8", errors="replace")[:size].ljust(size, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)


def payload_text(payload: Tensor) -> str:
    """Inverse of :func:`text_payload`."""
    return payload.contiguous().view(torch.uint8).numpy().tobytes().rstrip(b"\0").decode("utf-8", errors="replace")
