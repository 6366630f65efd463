"""State transfer on a data path of its own: a donor sends the training state to one recipient over a two-rank
gloo group built for that transfer, never through the store.

Per transfer the two ranks build a fresh ``ProcessGroupGloo`` over ``PrefixStore("<run>/state/<recipient>/<id>",
store)`` (the rendezvous is the only use of the store: two keys of a few dozen bytes, deleted when the transfer
ends). On that group travel, in order:

1. a header: one int64 tensor ``[version, metadata bytes, tensor bytes]``;
2. the metadata: the state's tree as plain data, JSON with every tensor replaced by its :class:`Slot` (path,
   shape, dtype; :mod:`~lightning_pgc.runtime.skeleton`: no pickle). Its size grows with the number of tensors,
   not with their size; non-tensor leaves (an optimizer's hyperparameters, a scheduler's counters, a metric's
   Python values) travel in it. A state holding anything else than plain data is refused on the donor, which tells
   the recipient why instead (:class:`StateRefused` there);
3. every tensor's bytes, in chunks of at most ``chunk_bytes``, each under a tag of its own, all in flight at once
   (host memory). The recipient receives each one straight into its own tensor of the same path, shape and dtype
   when it has one (its parameters, buffers and optimizer state: no copy), else into a new tensor. A tensor of
   the recipient's whose path the donor's state has with another shape or dtype is a :class:`StateMismatch`
   naming the path, before any tensor's bytes are received.

CUDA tensors travel through one host buffer of ``chunk_bytes`` on each side (gloo sends host memory), so a transfer
never holds a second copy of the state on either side. Either side that fails (the peer died, froze past the
group's timeout, or sent something else) raises :class:`TransferFailed`; :class:`Pair` deletes its rendezvous keys
either way.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pgc.runtime.skeleton import MalformedState, Slot, Unsendable, from_json, to_json

__all__ = [
    "CHUNK_BYTES",
    "ForwardingStore",
    "Pair",
    "Slot",
    "StateMismatch",
    "StateRefused",
    "TransferFailed",
    "Unsendable",
    "flatten",
    "paths",
    "receive",
    "send",
    "unflatten",
]

#: The largest piece of a tensor one send carries (and the size of the host buffer a CUDA tensor is staged in).
CHUNK_BYTES = 16 << 20


#: The largest metadata a recipient reads (JSON of the state's tree: about a hundred bytes per tensor).
META_LIMIT = 256 << 20


class TransferFailed(RuntimeError):
    """A state transfer did not complete (the peer died or froze, or sent something else than a state): it may be
    asked for again."""


class StateRefused(RuntimeError):
    """The donor cannot send its state (it holds a value that is not plain data; the donor's reason is the message)."""


class StateMismatch(RuntimeError):
    """The donor's state does not fit the recipient's own (a tensor of another shape or dtype at the same path)."""


def _rebuild(node: Any, items: list[tuple[Any, Any]]) -> Any:
    """A container of ``node``'s kind holding ``items`` (``(key, value)`` pairs; keys unused for sequences)."""
    if isinstance(node, OrderedDict):
        out: Any = OrderedDict(items)
        if hasattr(node, "_metadata"):  # a module's state dict: its version information, for load_state_dict
            out._metadata = node._metadata
        return out
    if isinstance(node, dict):
        return dict(items)
    values = [v for _, v in items]
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*values)
    return tuple(values) if isinstance(node, tuple) else values


def _children(node: Any) -> Optional[list[tuple[Any, Any]]]:
    if isinstance(node, dict):
        return list(node.items())
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    return None


def flatten(tree: Any) -> tuple[Any, list[Tensor]]:
    """``(skeleton, tensors)``: ``tree`` (dicts, lists and tuples of anything) with each tensor replaced by its
    :class:`Slot`, and the tensors in slot order."""
    tensors: list[Tensor] = []

    def walk(node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, Tensor):
            tensors.append(node)
            return Slot(len(tensors) - 1, path, tuple(node.shape), node.dtype)
        children = _children(node)
        if children is None:
            return node
        return _rebuild(node, [(k, walk(v, (*path, k))) for k, v in children])

    return walk(tree, ()), tensors


def unflatten(skeleton: Any, tensors: list[Tensor]) -> Any:
    """The tree :func:`flatten` took apart, with ``tensors`` in its slots."""
    if isinstance(skeleton, Slot):
        return tensors[skeleton.index]
    children = _children(skeleton)
    if children is None:
        return skeleton
    return _rebuild(skeleton, [(k, unflatten(v, tensors)) for k, v in children])


def paths(tree: Any) -> dict[tuple[Any, ...], Tensor]:
    """Every tensor of ``tree`` by its path (the receiving side's targets)."""
    skeleton, tensors = flatten(tree)
    return {slot.path: tensors[slot.index] for slot in _slots(skeleton)}


def _slots(skeleton: Any) -> list[Slot]:
    found: list[Slot] = []

    def walk(node: Any) -> None:
        if isinstance(node, Slot):
            found.append(node)
            return
        for _, child in _children(node) or ():
            walk(child)

    walk(skeleton)
    return sorted(found, key=lambda s: s.index)


def _bytes_of(tensor: Tensor) -> Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


class ForwardingStore(dist.Store):
    """A store that forwards every call to ``inner`` and tells :meth:`touched` of every key it sets, reads, adds to
    or waits for, with the value it sets (for a ledger of keys, or a bound on values)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner

    def touched(self, key: str, value: Optional[bytes] = None) -> None:
        """Called before every call that names ``key`` (``value``: what it sets or pushes)."""

    def set(self, key: str, value: Any) -> None:
        self.touched(key, value)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.touched(key)
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self.touched(key)
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.touched(key, desired)
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        for key in keys:
            self.touched(key)
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.inner.timeout  # type: ignore[attr-defined]

    def queue_push(self, key: str, value: Any) -> None:
        self.touched(key, value)
        self.inner.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self.inner.queue_pop(key, block)

    def queue_len(self, key: str) -> int:
        return self.inner.queue_len(key)


class KeyLedger(ForwardingStore):
    """Remembers every key of one rendezvous (a transfer's pair, a configuration's data group), so that any member
    can delete them all when the group ends, those of a member that died too (every member reads every other's)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__(inner)
        self.keys: set[str] = set()

    def touched(self, key: str, value: Optional[bytes] = None) -> None:
        self.keys.add(key)

    def forget(self) -> None:
        for key in sorted(self.keys):
            try:
                self.inner.delete_key(key)
            except Exception:  # the store went away: nothing is left to clean
                return
        self.keys.clear()


class Pair:
    """The two-rank group of one transfer: ``index`` 0 is the donor, 1 the recipient.

    Args:
        store: a store connection of this thread's (only the rendezvous goes through it).
        key: the transfer's namespace in the store (the same on both sides, new for every transfer).
        timeout: how long building the group, and each send or receive, waits for the peer.

    Raises:
        TransferFailed: the peer did not come within ``timeout``.
    """

    def __init__(self, store: dist.Store, key: str, index: int, timeout: timedelta) -> None:
        self.index = index
        self._ledger = KeyLedger(store)
        self.pg: Any = None
        try:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore(key, self._ledger), index, 2, timeout)
        except Exception as exc:
            self.close()
            raise TransferFailed(f"the peer of state transfer {key} did not come: {exc}") from exc

    def __enter__(self) -> "Pair":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Drop the group's connections and delete the rendezvous keys."""
        self.pg = None
        self._ledger.forget()

    def send(self, tensor: Tensor, tag: int = 0, wait: bool = True) -> Any:
        """Send ``tensor`` to the peer under ``tag``; with ``wait=False`` return the work to :meth:`finish` (the
        tensor must stay alive and unchanged until then)."""
        return self._post(self.pg.send, tensor, tag, wait, "sending")

    def recv(self, tensor: Tensor, tag: int = 0, wait: bool = True) -> Any:
        """Receive into ``tensor`` from the peer under ``tag``; ``wait=False`` as for :meth:`send`."""
        return self._post(self.pg.recv, tensor, tag, wait, "receiving")

    def _post(self, op: Callable[..., Any], tensor: Tensor, tag: int, wait: bool, doing: str) -> Any:
        try:
            work = op([tensor], 1 - self.index, tag)
        except Exception as exc:
            raise TransferFailed(f"{doing} {tensor.numel()} bytes failed: {exc}") from exc
        return self.finish([work]) if wait else work

    def finish(self, works: list[Any]) -> None:
        """Wait for every work of :meth:`send` or :meth:`recv` (``wait=False``)."""
        try:
            for work in works:
                work.wait()
        except Exception as exc:
            raise TransferFailed(f"the transfer broke off: {exc}") from exc


def _staging(chunk_bytes: int) -> Callable[[int], Tensor]:
    """A lazily allocated host buffer of ``chunk_bytes`` (pinned when CUDA is available): its first ``n`` bytes."""
    holder: list[Tensor] = []

    def get(n: int) -> Tensor:
        if not holder:
            holder.append(torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available()))
        return holder[0][:n]

    return get


def send(pair: Pair, version: int, tree: Any, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Send ``tree`` (the state at the start of ``version``) to the pair's recipient; returns the tensor bytes sent.

    Raises:
        TransferFailed: the recipient died or froze.
        Unsendable: ``tree`` holds a value that is not plain data (the recipient was told why).
    """
    skeleton, tensors = flatten(tree)
    try:
        meta = to_json(skeleton)
    except Unsendable as exc:
        reason = str(exc).encode()[:65536]
        pair.send(torch.tensor([version, -len(reason), 0], dtype=torch.int64))
        pair.send(torch.frombuffer(bytearray(reason), dtype=torch.uint8))
        raise
    total = sum(t.numel() * t.element_size() for t in tensors)
    pair.send(torch.tensor([version, len(meta), total], dtype=torch.int64))
    pair.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
    staging = _staging(chunk_bytes)
    pending, tag = [], 1
    for tensor in tensors:
        flat = _bytes_of(tensor if tensor.is_contiguous() else tensor.contiguous())
        for start in range(0, flat.numel(), chunk_bytes):
            piece = flat[start : start + chunk_bytes]
            if piece.device.type == "cpu":  # host memory: every chunk in flight at once, from the tensor itself
                pending.append(pair.send(piece, tag, wait=False))
            else:  # through the one host buffer: a chunk at a time
                host = staging(piece.numel())
                host.copy_(piece)
                pair.send(host, tag)
            tag += 1
    pair.finish(pending)
    return total


def _metadata(pair: Pair, version: int) -> tuple[Any, int]:
    """The donor's header and skeleton: ``(skeleton, tensor bytes)``, checked."""
    header = torch.zeros(3, dtype=torch.int64)
    pair.recv(header)
    sent_for, meta_bytes, total = (int(x) for x in header.tolist())
    if sent_for != version:
        raise TransferFailed(f"the donor sent the state of version {sent_for}, not of version {version}")
    if not -65536 <= meta_bytes <= META_LIMIT or total < 0:
        raise TransferFailed(f"the donor's header is not a state's: {header.tolist()}")
    meta = torch.empty(abs(meta_bytes), dtype=torch.uint8)
    pair.recv(meta)
    data = meta.numpy().tobytes()
    if meta_bytes < 0:
        raise StateRefused(f"the donor cannot send its state: {data.decode(errors='replace')}")
    try:
        skeleton = from_json(data)
    except MalformedState as exc:
        raise TransferFailed(f"the donor's metadata is not a state tree: {exc}") from exc
    slots = _slots(skeleton)
    if [s.index for s in slots] != list(range(len(slots))):
        raise TransferFailed("the donor's metadata numbers its tensors wrongly")
    if sum(_nbytes(s) for s in slots) != total:
        raise TransferFailed(f"the donor's tensors add up to {sum(_nbytes(s) for s in slots)} bytes, not {total}")
    return skeleton, total


def _nbytes(slot: Slot) -> int:
    return math.prod(slot.shape) * torch.empty((), dtype=slot.dtype).element_size()


def _target(slot: Slot, targets: dict[tuple[Any, ...], Tensor], device: torch.device) -> Tensor:
    """Where ``slot``'s bytes land: the recipient's own tensor at its path (which must have its shape and dtype),
    else a new one on ``device``."""
    dst = targets.get(slot.path)
    if isinstance(dst, Tensor):
        if tuple(dst.shape) != slot.shape or dst.dtype != slot.dtype:
            where = "/".join(str(p) for p in slot.path)
            raise StateMismatch(
                f"the donor's state does not fit this rank's: {where} is {_dtype(slot.dtype)} {list(slot.shape)} "
                f"there, {_dtype(dst.dtype)} {list(dst.shape)} here (is every rank running the same model and "
                "optimizer?)"
            )
        if dst.is_contiguous():
            return dst
    return torch.empty(slot.shape, dtype=slot.dtype, device=device)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def receive(
    pair: Pair,
    version: int,
    into: Any = None,
    device: torch.device = torch.device("cpu"),
    chunk_bytes: int = CHUNK_BYTES,
) -> Any:
    """Receive the tree the pair's donor sends for ``version``. Each tensor lands in the tensor of ``into`` at the
    same path when that one is contiguous (in place), else in a new one on ``device``.

    Raises:
        TransferFailed: the donor died or froze, or sent the state of another version, or something else than a
            state.
        StateRefused: the donor's state holds something else than plain data (the donor's reason).
        StateMismatch: a tensor of ``into`` whose path the donor's state has with another shape or dtype (named).
    """
    skeleton, total = _metadata(pair, version)
    targets = paths(into) if into is not None else {}
    tensors = [_target(slot, targets, device) for slot in _slots(skeleton)]  # (every mismatch before any byte)
    staging = _staging(chunk_bytes)
    pending, got, tag = [], 0, 1
    for dst in tensors:
        flat = _bytes_of(dst)
        with torch.no_grad():
            for start in range(0, flat.numel(), chunk_bytes):
                piece = flat[start : start + chunk_bytes]
                if piece.device.type == "cpu":  # straight into the tensor, every chunk posted at once
                    pending.append(pair.recv(piece, tag, wait=False))
                else:
                    host = staging(piece.numel())
                    pair.recv(host, tag)
                    piece.copy_(host)
                tag += 1
        got += flat.numel()
    pair.finish(pending)
    if got != total:
        raise TransferFailed(f"received {got} bytes of tensors, the donor sent {total}")
    return unflatten(skeleton, tensors)
