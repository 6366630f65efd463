"""A state transfer's metadata as plain data: the state's tree, every tensor replaced by its :class:`Slot`, as JSON.

What a state holds besides tensors is what a ``torch.load(weights_only=True)`` checkpoint may hold: None, bools,
ints, floats, complex numbers, strings, bytes, lists, tuples, sets, dicts and ``OrderedDict`` (a module's state
dict keeps its ``_metadata``), ``torch.dtype``, ``torch.device``, plus NumPy arrays and scalars (NumPy's generator
state). Each non-JSON value travels as a one-key object naming its kind (``{"t": [...]}`` a tuple, ``{"d": [[key,
value], ...]}`` a dict, ``{"x": [index, path, shape, dtype]}`` a tensor's slot...). Nothing is unpickled and no
class is looked up by name: a tree that holds anything else (a named tuple, a dataclass, a function) is refused on
the sending side, naming where (:class:`Unsendable`), and metadata that does not fit this format on the receiving
side (:class:`MalformedState`).

No torch.distributed here.
"""

from __future__ import annotations

import base64
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["MalformedState", "Slot", "Unsendable", "from_json", "to_json"]


class Unsendable(TypeError):
    """A state holds a value the state transfer does not carry (it names the value's path and type)."""


class MalformedState(ValueError):
    """Received metadata that is not a state tree of this format."""


@dataclass(frozen=True)
class Slot:
    """Where a tensor was in the state's tree (``path``: the keys and indices from the root), its shape and dtype."""

    index: int
    path: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


#: Every dtype by its name (``float32``), the only ones a slot may name.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
#: NumPy dtypes an array may have (numbers and bools: nothing that holds objects).
_NUMPY_KINDS = "biuf"


def _where(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path) or "the root"


def _plain(node: Any, path: tuple[Any, ...]) -> Any:
    """``node`` as JSON-ready data (see the module's docstring)."""
    if node is None or isinstance(node, (bool, str)) or type(node) in (int, float):
        return node
    if isinstance(node, Slot):
        return {"x": [node.index, [_plain(p, path) for p in node.path], list(node.shape), _dtype_name(node.dtype)]}
    if isinstance(node, dict):
        items = [[_plain(k, path), _plain(v, (*path, k))] for k, v in node.items()]
        if isinstance(node, OrderedDict):
            meta = getattr(node, "_metadata", None)
            return {"o": items} if meta is None else {"o": items, "m": _plain(meta, (*path, "_metadata"))}
        return {"d": items}
    if isinstance(node, list):
        return [_plain(v, (*path, i)) for i, v in enumerate(node)]
    if isinstance(node, tuple) and not hasattr(node, "_fields"):  # (torch.Size too; not a named tuple)
        return {"t": [_plain(v, (*path, i)) for i, v in enumerate(node)]}
    return _plain_leaf(node, path)


def _plain_leaf(node: Any, path: tuple[Any, ...]) -> Any:
    if isinstance(node, (set, frozenset)):
        return {"s" if isinstance(node, set) else "f": [_plain(v, path) for v in node]}
    if isinstance(node, (int, float)):  # an int or float subclass (NumPy's float64, an IntEnum): its value
        return int(node) if isinstance(node, int) else float(node)
    if isinstance(node, complex):
        return {"c": [node.real, node.imag]}
    if isinstance(node, bytes):
        return {"b": base64.b64encode(node).decode()}
    if isinstance(node, torch.dtype):
        return {"dt": _dtype_name(node)}
    if isinstance(node, torch.device):
        return {"dev": str(node)}
    if isinstance(node, np.ndarray) and node.dtype.kind in _NUMPY_KINDS:
        return {"a": [node.dtype.str, list(node.shape), node.reshape(-1).tolist()]}
    if isinstance(node, np.generic) and node.dtype.kind in _NUMPY_KINDS:
        return node.item()
    raise Unsendable(
        f"the state holds a {type(node).__module__}.{type(node).__qualname__} at {_where(path)}, which a state "
        "transfer does not carry (plain data only: numbers, strings, bytes, lists, tuples, sets, dicts, tensors, "
        "NumPy arrays; what a weights_only checkpoint holds)"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_json(skeleton: Any) -> bytes:
    """The bytes of ``skeleton`` (a tree from :func:`~lightning_pgc.runtime.transfer.flatten`).

    Raises:
        Unsendable: it holds a value of another kind than the module's docstring lists.
    """
    return json.dumps(_plain(skeleton, ()), separators=(",", ":")).encode()


def _int(value: Any, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise MalformedState(f"expected an integer of at least {lo}, got {value!r:.40}")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise MalformedState(f"expected a list, got {type(value).__name__}")
    return value


def _pairs(value: Any) -> list[tuple[Any, Any]]:
    pairs = [_list(p) for p in _list(value)]
    if any(len(p) != 2 for p in pairs):
        raise MalformedState("a dict's items must be [key, value] pairs")
    return [(_key(k), _tree(v)) for k, v in pairs]


def _key(value: Any) -> Any:
    key = _tree(value)
    if isinstance(key, (dict, list, set, Slot)):
        raise MalformedState(f"a dict key cannot be a {type(key).__name__}")
    return key


def _slot(value: Any) -> Slot:
    index, path, shape, dtype = _items(value, 4)
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise MalformedState(f"unknown dtype {dtype!r:.40}")
    return Slot(_int(index), tuple(_key(p) for p in _list(path)), tuple(_int(s) for s in _list(shape)), DTYPES[dtype])


def _items(value: Any, n: int) -> list[Any]:
    items = _list(value)
    if len(items) != n:
        raise MalformedState(f"expected {n} entries, got {len(items)}")
    return items


def _ordered(value: dict[str, Any]) -> Any:
    out: Any = OrderedDict(_pairs(value["o"]))
    if "m" in value:
        out._metadata = _tree(value["m"])
    return out


def _array(value: Any) -> np.ndarray:
    dtype, shape, flat = _items(value, 3)
    if not isinstance(dtype, str) or np.dtype(dtype).kind not in _NUMPY_KINDS:
        raise MalformedState(f"a NumPy array of dtype {dtype!r:.40}")
    return np.array(_list(flat), dtype=np.dtype(dtype)).reshape([_int(s) for s in _list(shape)])


def _complex(value: Any) -> complex:
    real, imag = _items(value, 2)
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (real, imag)):
        raise MalformedState("a complex number's parts must be numbers")
    return complex(real, imag)


#: How each tag reads back.
_TAGS: dict[str, Callable[[Any], Any]] = {
    "x": _slot,
    "d": lambda v: dict(_pairs(v)),
    "t": lambda v: tuple(_tree(x) for x in _list(v)),
    "s": lambda v: {_key(x) for x in _list(v)},
    "f": lambda v: frozenset(_key(x) for x in _list(v)),
    "c": _complex,
    "b": lambda v: base64.b64decode(v.encode() if isinstance(v, str) else b"?", validate=True),
    "dt": lambda v: DTYPES[v] if isinstance(v, str) and v in DTYPES else _bad(f"unknown dtype {v!r:.40}"),
    "dev": lambda v: torch.device(v) if isinstance(v, str) else _bad("a device must be a string"),
    "a": _array,
}


def _bad(reason: str) -> Any:
    raise MalformedState(reason)


def _tree(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_tree(v) for v in value]
    if not isinstance(value, dict) or not value:
        raise MalformedState(f"unexpected {type(value).__name__}")
    if "o" in value and set(value) <= {"o", "m"}:
        return _ordered(value)
    if len(value) != 1 or next(iter(value)) not in _TAGS:
        raise MalformedState(f"unknown node {sorted(value)!r:.60}")
    tag, body = next(iter(value.items()))
    return _TAGS[tag](body)


def from_json(data: bytes) -> Any:
    """The skeleton ``data`` carries (:func:`to_json`'s), its slots numbered ``0 .. k-1`` once each.

    Raises:
        MalformedState: ``data`` is not such a skeleton.
    """
    try:
        skeleton = _tree(json.loads(data.decode("utf-8")))
    except MalformedState:
        raise
    except (ValueError, TypeError, KeyError, RecursionError, RuntimeError) as exc:
        raise MalformedState(f"{type(exc).__name__}: {exc}") from None
    return skeleton
