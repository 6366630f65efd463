"""Collectives among the live ranks, through the leader, on the runtime's own point-to-point streams.

Lightning's own collectives during fit (validation ``sync_dist`` reduces, checkpoint barriers and broadcasts,
``reduce_boolean_decision``) run on the default process group, which needs every rank: one dead rank makes
them fail or hang. :class:`LiveGather` replaces them while the runtime runs: every rank sends its (pickled)
contribution to the leader on the ``COLL`` channel; the leader waits for every rank that is still in the job
(not finished, not dead, not silent past the heartbeat window plus ``timeout``) and sends the same contributions
to all of them. :class:`LiveCollectives` builds barrier, broadcast, reduce and all-gather on top; every rank
combines the same bytes in rank order, so the results are bit-identical everywhere.
"""

from __future__ import annotations

import io
import pickle
import queue
import threading
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_pgc.runtime.transport import Channel, Transport

__all__ = ["CollectiveError", "LiveCollectives", "LiveGather", "OPS"]

#: Operation codes carried with each contribution: all ranks of one collective must run the same one.
OPS = {"barrier": 1, "broadcast": 2, "reduce": 3, "all_gather": 4}
_NAMES = {v: k for k, v in OPS.items()}
_MISMATCH = 0  # the leader's answer when the ranks called different collectives (payload: the error text)
_KNOWN = 1000  # operation ``_KNOWN + op``: "the result of this collective was this" (to a new leader)
_HEADER = 3  # int64 words: sequence number, payload bytes, operation (sequence -1: the stream ends)


class CollectiveError(RuntimeError):
    """A collective among the live ranks could not complete (mismatched calls, a source rank gone)."""


def _dumps(obj: Any) -> Tensor:
    buf = io.BytesIO()
    pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def _loads(data: Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


class LiveGather:
    """One gather-to-all among the live ranks per call, through the leader.

    Call order: :meth:`start` once (after the transport exists), :meth:`gather` on every live rank in the same
    order (as for any collective), :meth:`stop` once. The leader needs ``members()``, the ranks it waits for,
    and ``failure()``, the error that ends every wait; a worker needs ``failure()`` and ``check_leader(doing)``,
    which raises once the leader is silent for a heartbeat window.

    Args:
        transport: the runtime's streams (``Channel.COLL`` is used only here).
        rank, world_size, leader: this rank, the number of ranks, the leader's rank.
        poll_s: seconds between liveness checks while waiting.
        members: leader only: the ranks a collective waits for now (this one included).
        failure: the runtime's error, if it failed (every wait then raises it).
        check_leader: worker only: raises if the leader is gone.
        send: ``send(channel, tensor, peers)``: the runtime's asynchronous, ordered send.
        waiting: called on the calling thread while a collective waits (the runtime donates its training state
            there to a rank that rejoins, which the collective may be waiting for).
        failover: the leader may be replaced (:meth:`set_leader`); a collective in flight then completes through
            the new leader, with the result some rank may already have got from the old one.
    """

    def __init__(
        self,
        transport: Transport,
        rank: int,
        world_size: int,
        leader: int,
        poll_s: float,
        members: Callable[[], set[int]],
        failure: Callable[[], Optional[BaseException]],
        check_leader: Callable[[str], None],
        send: Callable[[Channel, Tensor, list[int]], None],
        waiting: Callable[[], None] = lambda: None,
        failover: bool = False,
    ) -> None:
        self.transport = transport
        self.rank, self.world_size, self.leader = rank, world_size, leader
        self.poll_s = poll_s
        self.members, self.failure, self.check_leader, self._send = members, failure, check_leader, send
        self.waiting = waiting
        self.failover = failover
        self._pending: Optional[tuple[int, int, Tensor]] = None  # (seq, op, payload) of the collective in flight
        self._last: Optional[tuple[int, int, Tensor]] = None  # (seq, op, result) of the last one completed here
        self.peers = [r for r in range(world_size) if r != rank]
        self.seq = 0
        self.threads: list[threading.Thread] = []
        self._cond = threading.Condition()
        self._inbox: dict[int, dict[int, tuple[int, Tensor]]] = {}  # leader: seq -> rank -> (op, payload)
        self._done: dict[int, tuple[int, Tensor]] = {}  # leader: recent results, for a rank that comes back late
        self._results: queue.Queue = queue.Queue()  # worker: (seq, op, payload) or an exception
        self._send_lock = threading.Lock()
        self.lost: set[int] = set()  # peers whose COLL stream broke
        self._led = False  # this rank was the leader and stepped down: every peer still listens to it
        self._former: set[int] = set()  # leaders that were replaced alive: they still listen to this rank
        self._listening: set[int] = set()  # peers a receiving thread was started for

    def start(self) -> None:
        """Start the receiving threads (leader: one per peer; worker: one for the leader)."""
        self._listen(self.peers if self.rank == self.leader else [self.leader])

    def _listen(self, sources: list[int]) -> None:
        """One receiving thread per peer, whatever role it serves (it reads ``self.leader`` at each message)."""
        for peer in sources:
            if peer in self._listening:
                continue
            self._listening.add(peer)
            t = threading.Thread(target=self._receive, args=(peer,), name=f"pgc-coll-recv-{peer}", daemon=True)
            t.start()
            self.threads.append(t)

    def set_leader(self, leader: int, gone: bool = True) -> None:
        """The leader died (``gone``) or froze, and ``leader`` took over (any thread): later collectives go through
        it. A collective in flight at that moment completes through it (:meth:`_await` re-sends the contribution);
        this rank tells it the result of the last collective it completed, which stands for the ranks that did
        not get it (ranks are at most one collective apart)."""
        with self._cond:
            if leader == self.leader:
                return
            old, self.leader = self.leader, leader
            if gone:
                self.lost.add(old)
            elif old != self.rank:
                self._former.add(old)
            self._led |= old == self.rank
            last = self._last
            if leader == self.rank and last is not None:  # answer late re-posts of it with the same result
                self._done.setdefault(last[0], (last[1], last[2]))
            self._cond.notify_all()
        self._listen([p for p in self.peers if p not in self.lost] if leader == self.rank else [leader])
        if leader != self.rank and last is not None:  # ranks still waiting for it must get this same result
            self._post([leader], last[0], _KNOWN + last[1], last[2])

    def stop(self) -> None:
        """End this rank's outgoing COLL streams (their receivers return); call once, after the last gather."""
        if self.rank == self.leader or self._led:
            targets = [p for p in self.peers if p not in self.lost]
        else:
            targets = [self.leader, *sorted(self._former - self.lost)]
        self._post(targets, -1, 0, torch.zeros(0, dtype=torch.uint8))

    def _post(self, peers: list[int], seq: int, op: int, payload: Tensor) -> None:
        header = torch.tensor([seq, payload.numel(), op], dtype=torch.int64)
        with self._send_lock:  # header and payload stay adjacent on each stream
            self._send(Channel.COLL, header, peers)
            if payload.numel():
                self._send(Channel.COLL, payload, peers)

    def _receive(self, peer: int) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        while True:
            try:
                self.transport.recv(Channel.COLL, peer, header)
                seq, size, op = header.tolist()
                payload = torch.empty(max(size, 0), dtype=torch.uint8)
                if size > 0:
                    self.transport.recv(Channel.COLL, peer, payload)
            except Exception as exc:  # the peer's process is gone
                with self._cond:
                    self.lost.add(peer)
                    self._cond.notify_all()
                if self.rank != self.leader:
                    self._results.put((peer, exc))
                return
            if seq < 0:
                return
            if op >= _KNOWN:  # a rank got this collective's result from a leader that is gone: it stands
                with self._cond:
                    self._done.setdefault(seq, (op - _KNOWN, payload))
                    self._cond.notify_all()
                continue
            if self.rank != self.leader:
                self._results.put((peer, seq, op, payload))
                continue
            with self._cond:
                done = self._done.get(seq)
                if done is None:
                    self._inbox.setdefault(seq, {})[peer] = (op, payload)
                    self._cond.notify_all()
            if done is not None:  # it was left out (silent for too long) and is back: it gets the same result
                self._post([peer], seq, *done)

    def gather(self, op: str, obj: Any) -> dict[int, Any]:
        """``{rank: obj}`` of every live rank (this one included), identical on every rank.

        Raises:
            CollectiveError: the ranks called different collectives at this point.
            RuntimeError: the runtime failed, or (worker) the leader is gone.
        """
        self.seq += 1
        code, payload = OPS[op], _dumps(obj)
        self._pending = (self.seq, code, payload)
        if self.rank == self.leader:
            op_code, result = self._collect(self.seq, code, payload)
        else:
            leader = self.leader
            self._post([leader], self.seq, code, payload)
            op_code, result = self._await(self.seq, leader)
        with self._cond:
            self._pending, self._last = None, (self.seq, op_code, result)
        if op_code == _MISMATCH:
            raise CollectiveError(_loads(result))
        if op_code != code:
            raise CollectiveError(self._mismatch(op, _NAMES.get(op_code, str(op_code))))
        return {r: _loads(p) for r, p in _loads(result).items()}

    def _mismatch(self, mine: str, other: str) -> str:
        return (
            f"PGC rank {self.rank}: collective {self.seq} is a {mine} here but a {other} on another rank; every "
            "rank must call the same collectives in the same order (e.g. `self.log(..., sync_dist=True)` on "
            "every rank, not under `if self.global_rank == 0`)"
        )

    def _collect(self, seq: int, code: int, payload: Tensor) -> tuple[int, Tensor]:
        """Leader: wait for every member's contribution, then send the result to them."""
        with self._cond:
            got = self._inbox.setdefault(seq, {})
            got[self.rank] = (code, payload)
        while True:
            with self._cond:
                failure = self.failure()
                if failure is not None:
                    raise RuntimeError(f"PGC collective {seq} abandoned: {failure}") from failure
                known = self._done.get(seq)
                if known is not None:  # decided by a leader that is gone: everyone gets that result
                    self._inbox.pop(seq, None)
                    break
                members = (self.members() - self.lost) | {self.rank}
                if members <= set(got):
                    del self._inbox[seq]
                    break
                self._cond.wait(self.poll_s)
            self.waiting()
        if known is not None:
            self._post(sorted(r for r in got if r != self.rank), seq, *known)
            return known
        ops = {r: op for r, (op, _) in got.items()}
        if len(set(ops.values())) > 1:  # every rank gets the error (code _MISMATCH), not only the leader
            names = {r: _NAMES.get(op, str(op)) for r, op in sorted(ops.items())}
            code, result = (
                _MISMATCH,
                _dumps(
                    f"PGC collective {seq}: the ranks called different collectives: "
                    f"{names}; every rank must call the same collectives in the same order"
                ),
            )
        else:
            result = _dumps({r: got[r][1] for r in sorted(got)})
        with self._cond:
            self._done[seq] = (code, result)
            self._done.pop(seq - 16, None)
        self._post(sorted(r for r in got if r != self.rank), seq, code, result)
        return code, result

    def _await(self, seq: int, leader: int) -> tuple[int, Tensor]:
        """Worker: the result for ``seq`` from ``leader`` (the one the contribution went to)."""
        while True:
            failure = self.failure()
            if failure is not None:
                raise RuntimeError(f"PGC collective {seq} abandoned: {failure}") from failure
            if self.leader != leader and self._pending is not None:  # replaced while this one was in flight
                leader = self.leader
                _, code, mine = self._pending
                if leader == self.rank:
                    return self._collect(seq, code, mine)
                self._post([leader], seq, code, mine)
            try:
                item = self._results.get(timeout=self.poll_s)
            except queue.Empty:
                self.check_leader(f"in collective {seq} (a barrier, broadcast or reduce)")
                self.waiting()
                continue
            if len(item) == 2:  # (peer, error): a leader's stream broke
                peer, exc = item
                if peer != leader or self.failover:
                    continue  # a leader that died before this collective, or one being replaced now
                raise RuntimeError(
                    f"PGC rank {self.rank} lost the leader's stream (rank {peer}) during collective {seq}: {exc!r}"
                ) from exc
            peer, got, op, payload = item
            if peer != self.leader:
                continue  # from a leader that froze and was replaced: void
            leader = peer
            if got == seq:
                return op, payload
            if got > seq:
                raise CollectiveError(
                    f"PGC rank {self.rank}: got the result of collective {got} while waiting for "
                    f"{seq}; ranks are out of step"
                )


class LiveCollectives:
    """Barrier, broadcast, reduce and all-gather over a :class:`LiveGather` (the live ranks only).

    Raises (each method):
        CollectiveError: a broadcast whose source is gone, or an all-gather while ranks are missing (its result
            would not have ``world_size`` rows).
    """

    def __init__(self, gather: LiveGather) -> None:
        self.gather = gather

    def barrier(self) -> None:
        self.gather.gather("barrier", None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        got = self.gather.gather("broadcast", obj if self.gather.rank == src else None)
        if src not in got:
            raise CollectiveError(
                f"broadcast from rank {src}, which is no longer in the job (ranks left: {sorted(got)})"
            )
        return got[src]

    def reduce(self, tensor: Tensor, reduce_op: Any = "mean") -> Tensor:
        """``sum``, ``mean``/``avg``, ``max``, ``min`` or ``product`` over the live ranks (mean: their number)."""
        op = _op_name(reduce_op)
        got = self.gather.gather("reduce", tensor.detach().to("cpu"))
        values = torch.stack([got[r] for r in sorted(got)])
        if op in ("sum", "mean", "avg"):
            out = values.sum(0)
            if op != "sum":
                out = out / len(got)
        elif op == "max":
            out = values.amax(0)
        elif op == "min":
            out = values.amin(0)
        elif op == "product":
            out = values.prod(0)
        else:
            raise CollectiveError(f"reduce op {reduce_op!r} is not supported by the PGC live-rank reduce")
        return out.to(device=tensor.device, dtype=out.dtype if op in ("mean", "avg") else tensor.dtype)

    def all_gather(self, tensor: Tensor) -> Tensor:
        got = self.gather.gather("all_gather", tensor.detach().to("cpu"))
        missing = [r for r in range(self.gather.world_size) if r not in got]
        if missing:
            raise CollectiveError(
                f"all_gather while ranks {missing} are gone: the result would lack their rows; "
                "gather only where every rank is alive, or use a reduce"
            )
        return torch.stack([got[r] for r in range(self.gather.world_size)]).to(tensor.device)


def _op_name(reduce_op: Any) -> str:
    """``"sum"``, ``"mean"`` ... from a string or a ``torch.distributed.ReduceOp``."""
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        return reduce_op.lower()
    name = getattr(reduce_op, "name", None) or str(reduce_op).rsplit(".", 1)[-1]
    return {"AVG": "avg", "SUM": "sum", "MAX": "max", "MIN": "min", "PRODUCT": "product"}.get(
        name.upper(), name.lower()
    )
