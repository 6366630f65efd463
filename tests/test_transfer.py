"""The state transport (:mod:`lightning_pgc.runtime.transfer`): a state tree travels whole over a two-rank gloo
group, in bounded chunks, into the recipient's own tensors; a failed peer is caught on the other side; the store
keeps nothing of it."""

from __future__ import annotations

import pickle
import random
import threading
import time
from collections import OrderedDict, namedtuple
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lightning_pgc.runtime.control import serve_store
from lightning_pgc.runtime.skeleton import MalformedState, from_json, to_json
from lightning_pgc.runtime.transfer import (
    Pair,
    Slot,
    StateMismatch,
    StateRefused,
    TransferFailed,
    Unsendable,
    flatten,
    paths,
    receive,
    send,
    unflatten,
)

Point = namedtuple("Point", "x y")
TIMEOUT = timedelta(seconds=5)


def _tree() -> Any:
    model: Any = OrderedDict(w=torch.randn(7, 5), b=torch.randn(5).double(), n=torch.tensor(3))
    model._metadata = OrderedDict({"": {"version": 1}})
    return {
        "model": model,
        "optimizers": [{"state": {0: {"momentum_buffer": torch.randn(7, 5)}}, "param_groups": [{"lr": 0.1}]}],
        "flags": (torch.tensor([True, False]), "name", None),
        "point": (torch.zeros(2, dtype=torch.int16), 4),
        "empty": torch.empty(0, 3),
        "plain": {  # what else an optimizer's, a scheduler's, a callback's state or the generators hold
            "numpy": np.random.get_state(),
            "python": random.getstate(),
            "keys": {0: 1.5, (1, "a"): float("inf"), None: -3},
            "set": {1, 2},
            "bytes": b"\x00\xff",
            "dtype": torch.float16,
            "device": torch.device("cpu"),
            "scalar": np.float64(0.25),
            "complex": 1 - 2j,
        },
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_flatten_keeps_every_container_and_leaf_and_unflatten_inverts_it():
    tree = _tree()
    tree["point"] = Point(*tree["point"])
    skeleton, tensors = flatten(tree)
    assert len(tensors) == 7 and all(isinstance(s, Slot) for s in skeleton["model"].values())
    back = unflatten(skeleton, tensors)
    assert _same(back, tree)
    assert back["model"]._metadata == tree["model"]._metadata  # a module's load_state_dict reads it
    assert isinstance(back["point"], Point)
    assert set(paths(tree)) == {
        ("model", "w"),
        ("model", "b"),
        ("model", "n"),
        ("optimizers", 0, "state", 0, "momentum_buffer"),
        ("flags", 0),
        ("point", 0),
        ("empty",),
    }


def _transfer(
    tree: Any, into: Any = None, chunk_bytes: int = 1 << 20, version: int = 5, expect: int = 5
) -> tuple[Any, dict[str, Any], Any]:
    store = serve_store()
    done: dict[str, Any] = {}

    def donor() -> None:
        try:
            with Pair(store.clone(), "t/0", 0, TIMEOUT) as pair:
                done["sent"] = send(pair, version, tree, chunk_bytes)
        except (TransferFailed, Unsendable) as exc:
            done["donor_error"] = exc

    thread = threading.Thread(target=donor)
    thread.start()
    try:
        with Pair(store.clone(), "t/0", 1, TIMEOUT) as pair:
            got = receive(pair, expect, into, chunk_bytes=chunk_bytes)
    finally:
        thread.join(10)
    return got, done, store


def test_a_state_travels_whole_in_chunks_into_the_recipients_own_tensors_and_leaves_no_key():
    tree = _tree()
    into = _tree()
    own = {path: t.data_ptr() for path, t in paths(into).items()}
    got, done, store = _transfer(tree, into, chunk_bytes=64)  # 64 bytes: every tensor in several chunks
    assert _same(got, tree)
    landed = paths(got)
    assert all(landed[path].data_ptr() == own[path] for path in own if own[path])  # in place, no copy
    assert done["sent"] == sum(t.numel() * t.element_size() for t in flatten(tree)[1])
    assert store.num_keys() <= 1  # (the server's own counter key): the rendezvous keys are gone


def test_the_metadata_is_plain_json_that_reads_back_the_same_skeleton():
    skeleton, _ = flatten(_tree())
    data = to_json(skeleton)
    assert b"\x80" not in data and data.startswith(b"{")  # JSON, not a pickle
    back = from_json(data)
    assert _same(back, skeleton) and back["model"]._metadata == skeleton["model"]._metadata
    np.random.set_state(back["plain"]["numpy"])  # the generators take their states back as they left
    random.setstate(back["plain"]["python"])


@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps({"w": 1}),
        b'{"exec": "os.system"}',
        b'{"x": [0, [], [2], "object"]}',  # a dtype that does not exist
        b'{"x": [0, [], [-2], "float32"]}',  # a negative shape
        b'{"a": ["O", [1], [null]]}',  # a NumPy array of objects
        b'{"d": [[[1], 2]]}',  # a list as a key
        b'{"dev": "no such device"}',
        b"[" * 100000,
        b"\xff",
    ],
)
def test_metadata_that_is_not_a_state_tree_is_refused(data):
    with pytest.raises(MalformedState):
        from_json(data)


def test_a_recipient_without_a_tensor_at_a_path_gets_a_new_one():
    tree = _tree()
    into = {"model": OrderedDict(w=torch.zeros(7, 5))}
    got, _, _ = _transfer(tree, into)
    assert _same(got, tree) and got["model"]["w"].data_ptr() == into["model"]["w"].data_ptr()


def test_a_state_that_does_not_fit_the_recipients_own_is_refused_naming_the_key():
    into = {"model": OrderedDict(w=torch.zeros(5, 7))}
    with pytest.raises(StateMismatch, match=r"model/w is float32 \[7, 5\] there, float32 \[5, 7\] here"):
        _transfer(_tree(), into)
    into = {"model": OrderedDict(b=torch.zeros(5))}
    with pytest.raises(StateMismatch, match=r"model/b is float64 \[5\] there, float32 \[5\] here"):
        _transfer(_tree(), into)


def test_a_state_that_is_not_plain_data_is_refused_on_both_sides_naming_where():
    tree = _tree()
    tree["callbacks"] = {"mine": {"point": Point(1, 2)}}
    with pytest.raises(StateRefused, match="the donor cannot send its state: .*Point at callbacks/mine/point") as err:
        _transfer(tree)
    assert "weights_only" in str(err.value)


def test_a_donor_that_sends_a_pickle_is_a_failed_transfer_and_nothing_is_unpickled(tmp_path):
    store = serve_store()
    planted = tmp_path / "planted"

    class Plant:
        def __reduce__(self):
            return (planted.mkdir, ())

    def donor() -> None:
        meta = pickle.dumps({"w": Plant()})
        with Pair(store.clone(), "t/3", 0, TIMEOUT) as pair:
            pair.send(torch.tensor([5, len(meta), 0], dtype=torch.int64))
            pair.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8))

    thread = threading.Thread(target=donor)
    thread.start()
    with pytest.raises(TransferFailed, match="not a state tree"):
        with Pair(store.clone(), "t/3", 1, TIMEOUT) as pair:
            receive(pair, 5)
    thread.join(10)
    assert not planted.exists()


def test_the_state_of_another_version_is_refused():
    with pytest.raises(TransferFailed, match="version 4, not of version 5"):
        _transfer(_tree(), version=4, expect=5)


def test_a_donor_that_dies_mid_transfer_fails_the_recipient_fast_and_leaves_no_key():
    store = serve_store()
    big = {"w": torch.randn(1 << 20)}

    def donor() -> None:
        pair = Pair(store.clone(), "t/1", 0, TIMEOUT)
        pair.send(torch.tensor([5, 10, 1 << 22], dtype=torch.int64))  # a header, then the donor is gone
        pair.close()

    thread = threading.Thread(target=donor)
    thread.start()
    start = time.monotonic()
    with pytest.raises(TransferFailed):
        with Pair(store.clone(), "t/1", 1, TIMEOUT) as pair:
            receive(pair, 5, big)
    thread.join(10)
    assert time.monotonic() - start < TIMEOUT.total_seconds() + 3
    assert store.num_keys() <= 1


def test_a_peer_that_never_comes_is_a_transfer_failure_after_the_timeout():
    store = serve_store()
    start = time.monotonic()
    with pytest.raises(TransferFailed, match="did not come"):
        Pair(store.clone(), "t/2", 0, timedelta(seconds=1))
    assert time.monotonic() - start < 10
    assert store.num_keys() <= 1


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CUDA tensors travel through the host buffer)"
)
def test_cuda_tensors_travel_through_a_bounded_host_buffer():
    tree = {"w": torch.randn(1000, device="cuda"), "b": torch.randn(3)}
    into = {"w": torch.zeros(1000, device="cuda")}
    got, _, _ = _transfer(tree, into, chunk_bytes=256)
    assert got["w"].device.type == "cuda" and torch.equal(got["w"].cpu(), tree["w"].cpu())
    assert got["w"].data_ptr() == into["w"].data_ptr()


def test_the_transport_uses_only_public_store_and_gloo_apis():
    """The store wrapper forwards what ``ProcessGroupGloo``'s rendezvous calls (a change in torch shows here)."""
    assert {"set", "get", "add", "compare_set", "wait", "check", "delete_key", "num_keys", "set_timeout"} <= set(
        dir(dist.Store)
    )
