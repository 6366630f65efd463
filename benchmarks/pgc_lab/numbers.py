"""The docs' numbers: where each number of README.md and docs/ stands, and the file, recipe or code it is read from.

Each number read (below) on README.md, docs/*.md and docs/results/*.md has a row in docs/results/numbers.csv:
``page``, ``section`` (its heading's text, "" above the first), ``context`` (literal text of one line, found once in
the section, that holds the number; rows of one context and number name its occurrences in order), ``number`` (as
shown) and ``source``. tests/test_docs_numbers.py checks the rows; ``python benchmarks/docs_numbers.py PAGE`` rebuilds.

**A source** is ``file#key``: a path from the repository's root and a ``.``-separated key path (globs: ``*``,
``slowrank-*``, ``one?slow?rank``; in a list, a key that is not an index selects the records with a string field
equal to it: ``arms.ignore_c2``, a ``job`` of ``.jsonl.gz`` run records). ``.json``, ``.jsonl``, ``.jsonl.gz``,
``.csv`` (a column), ``.yaml``, and ``.py``: a top-level name, a dotted name in one (``PGCStrategy.__init__``), a
parameter's default (``PGCStrategy.__init__.timeout``), a literal table's entry (``COSTS.comm``: a dict's value, or
the call whose first argument it is), an option (``--steps``) or ``__doc__``; code's numbers are its literals and
those its strings write. ``@`` asks for a summary (``@count`` of entries, ``@mean``, ``@median``, ``@sum``,
``@least``, ``@most``), then a unit (``@ms``, ``@min``, ``@h`` from seconds; ``@%`` from a fraction). A number is
its source's at the precision shown (``0.987``: 0.9865 to 0.9875); ``x`` marks a ratio, ``k`` and ``M`` 1e3, 1e6.

**Read**: every number in prose, lists, quotes, code spans, code blocks and table body rows, except integers below
10 (ranks, ``s``, ``c``, seeds: structure, not results); a number in a name (``bf16-mixed``, ``mlp_10m``,
``ResNet-18``, ``2.6.6``, ``16-bit``, ``seed[234]``); dates, clock times, a reference's year or number, a
dependency's release (``Lightning 2.6``); code a test runs as pasted (:data:`RUN_AS_PASTED`); generated text, which
tests/test_generated_pages.py, test_readme.py, test_grid_map.py and test_layout.py render again and compare (a block
between ``<!-- name:begin`` and ``<!-- name:end`` markers, a page of :data:`GENERATED`); HTML comments; table headers.
"""

from __future__ import annotations

import ast
import csv
import fnmatch
import functools
import gzip
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "results" / "numbers.csv"
NUMBER = re.compile(
    r"(?<![\w.])(?<![^\W\dx]-)"  # not inside a word or a version, nor a hyphenated name's part (ResNet-18)
    r"(?P<core>[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)"
    r"(?P<suffix>x|k|M)?"  # a ratio (0.79x), thousands (38k), millions (1.7M)
    r"(?!\w|\.\w|-(?:mixed|true|bit)\b)"  # not followed by a word, a version's next part, a precision's name
)
SCALE = {"": 1.0, "x": 1.0, "k": 1e3, "M": 1e6}
NOT_A_QUANTITY = re.compile(
    r"\b\d{4}-\d{2}-\d{2}(?:/\d{2})?(?:[ T]\d{2}:\d{2}(?::\d{2})?)?"  # a date, with its clock time
    r"|\b\d{1,2}:\d{2}(?::\d{2})?\b"  # a clock time
    r"|et al\.,? \(?\d{4}\)?|\((?:ICML|NeurIPS|ICLR) \d{4}\)|arXiv \d{4}\.\d{4,5}"  # a reference's year or number
    r"|\b(?:[Ll]ightning|torch|[Pp]ython)[ (]+\d+(?:\.\d+)+(?: or \d+(?:\.\d+)+)*"  # a release: Lightning 2.6
    r"|(?<=[A-Za-z_])\[\d+\]"  # a glob's character class in a name (``seed[234]``)
)
RUN_AS_PASTED = {"README.md": "A complete example"}  # page -> the section whose code tests/test_readme.py runs
GENERATED = {  # the pages a script writes whole
    f"docs/results/{name}.md"
    for name in "auto control_scale demo demo_full gpu_check memory rejoin safety_valve stall step_time step_time_planes step_time_passes "
    "staleness staleness_bounded staleness_emulated staleness_exponential staleness_stalls tasks".split()
}


def pages() -> list[str]:
    docs = [*sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "results").glob("*.md"))]
    return ["README.md", *(p.relative_to(ROOT).as_posix() for p in docs)]


def value(token: str) -> float:
    match = NUMBER.fullmatch(token)
    return float(match["core"]) * SCALE[match["suffix"] or ""]  # type: ignore[index]


@functools.lru_cache(maxsize=None)
def numbers_in(line: str) -> tuple[tuple[int, str], ...]:
    """(offset, token) of each number read on a line: decimals and integers from 10 (code spans read as text)."""
    masked = NOT_A_QUANTITY.sub(lambda m: " " * len(m.group()), line.replace("`", " "))
    found = NUMBER.finditer(masked)
    return tuple((m.start(), m.group()) for m in found if re.search(r"[.eE]", m["core"]) or abs(value(m.group())) >= 10)


Found = NamedTuple("Found", [("section", str), ("line", int), ("start", int), ("token", str)])  # a number read
Page = NamedTuple("Page", [("lines", list), ("sections", dict), ("found", list)])  # sections: heading -> its lines


def read_page(where: str, text: str) -> Page:
    lines, sections, found = text.splitlines(), {"": []}, []
    heading, kind, in_code, in_comment, generated = "", "", False, False, where in GENERATED
    for k, line in enumerate(lines, 1):
        generated |= bool(re.match(r"<!-- [\w-]+:begin", line))
        previous = kind
        if line.lstrip().startswith("```"):
            in_code, kind = not in_code, "fence"
        elif in_code:
            kind = "code"
        elif in_comment or re.match(r"\s*(?:>\s?)*\s*<!--", line):
            in_comment, kind = "-->" not in line, "comment"
        elif line.startswith("#"):
            heading, kind = line.lstrip("#").strip(), "heading"
            sections[heading] = []
        elif line.lstrip().startswith("|"):
            kind = "row" if previous in ("header", "separator", "row") else "header"
            kind = "separator" if re.match(r"^\s*\|[-:| ]+\|\s*$", line) else kind
        else:
            kind = "text"
        sections[heading].append(k)
        pasted = kind == "code" and RUN_AS_PASTED.get(where) == heading
        if kind in ("text", "heading", "row", "code") and not generated and not pasted:
            found += [Found(heading, k, i, token) for i, token in numbers_in(line)]
        generated &= where in GENERATED or not re.match(r"<!-- [\w-]+:end", line)
    return Page(lines, sections, found)


class Row(NamedTuple):
    page: str
    section: str
    context: str
    number: str
    source: str

    def __str__(self) -> str:
        return f"[{self.section}] {self.context!r}: {self.number} <- {self.source}"


def read_table(path: Path = TABLE) -> list[Row]:
    with open(path, newline="") as f:
        return [Row(**record) for record in csv.DictReader(f)]


def place(page: Page, rows: list[Row]) -> tuple[dict[Found, Row], list[str]]:
    """Each row's number on the page (a number -> its row), and why the rows that stand nowhere do not."""
    placed: dict[Found, Row] = {}
    wrong: list[str] = []
    by_line: dict[int, list[Found]] = {}
    for f in page.found:
        by_line.setdefault(f.line, []).append(f)
    taken: dict[tuple[str, str, str], int] = {}
    for row in rows:
        lines = page.sections.get(row.section, [])
        hits = [(k, i) for k in lines for i in occurrences(page.lines[k - 1], row.context)]
        if len(hits) != 1:
            wrong.append(f"{row}: its context stands {len(hits)} times in its section, not once")
            continue
        (k, i), key = hits[0], (row.section, row.context, row.number)
        inside = [f for f in by_line.get(k, []) if f.token == row.number and i <= f.start]
        inside = [f for f in inside if f.start + len(f.token) <= i + len(row.context)]
        n = taken[key] = taken.get(key, 0) + 1
        if len(inside) < n:
            wrong.append(f"{row}: the context holds {len(inside)} such numbers read, not {n}")
        elif inside[n - 1] in placed:
            wrong.append(f"{row}: line {k}'s {row.number} already has the row {placed[inside[n - 1]]}")
        else:
            placed[inside[n - 1]] = row
    return placed, wrong


def occurrences(text: str, part: str) -> list[int]:
    out = [text.find(part)]
    while out[-1] >= 0:
        out.append(text.find(part, out[-1] + 1))
    return out[:-1]


def check(where: str, page: Page, rows: list[Row]) -> list[str]:
    """Why a page's numbers and its rows disagree: rows that stand nowhere or whose source does not hold their
    number, numbers with no row. Empty: they agree."""
    placed, wrong = place(page, [row for row in rows if row.page == where])
    for row in placed.values():
        try:
            held = source_values(row.source)
            wrong += [] if shows(row.number, held) else [f"{row}: its source holds {', '.join(map(str, held[:8]))}"]
        except (KeyError, ValueError, OSError, SyntaxError) as e:
            wrong.append(f"{row}: {e!r}")
    unread = [f"{where}:{f.line}: {f.token}: no row ({f.section!r})" for f in page.found if f not in placed]
    return [f"{where}: {w}" for w in wrong] + unread


def shows(token: str, values: list[float]) -> bool:
    """Some value, shown at the precision of ``token``, is ``token``."""
    match = NUMBER.fullmatch(token)
    if not match:
        return False
    mantissa, _, exponent = match["core"].lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    half = 0.5 * 10.0 ** (int(exponent or 0) - decimals) * SCALE[match["suffix"] or ""] * 1.0001
    return (value(token) != 0 or not exponent) and any(abs(v - value(token)) <= half for v in values)


UNITS = {"ms": 1e3, "%": 1e2, "min": 1 / 60, "h": 1 / 3600}
SUMMARIES = {"mean": statistics.mean, "median": statistics.median, "sum": sum, "least": min, "most": max}


@functools.lru_cache(maxsize=None)
def source_values(source: str) -> list[float]:
    """The numbers a source names, after its asks; raises where its file or key does not exist."""
    citation, *asks = source.split("@")
    name, _, key = citation.partition("#")
    path, found = ROOT / name, []
    if path.suffix == ".py":
        values = _code_values(ast.parse(path.read_text()), key)
    else:
        found = [node for _, node in select(load(path), key.split("."))]
        values = numbers(found)
    if not found and not values:
        raise KeyError(f"{citation}: no {key} in {name}")
    values = [v for v in values if math.isfinite(v)]
    for ask in asks:
        if ask == "count":
            values = [float(len(found[0]) if len(found) == 1 and isinstance(found[0], (list, dict)) else len(found))]
        elif ask in SUMMARIES:
            values = [float(SUMMARIES[ask](values))]
        elif ask in UNITS:
            values = [v * UNITS[ask] for v in values]
        else:
            raise ValueError(f"{source}: ask for count, {', '.join(SUMMARIES)} or a unit ({', '.join(UNITS)})")
    return values


@functools.lru_cache(maxsize=None)
def load(path: Path) -> Any:
    """A results file or recipe, read once; a ``.csv`` as a dict of columns."""
    if path.suffix == ".yaml":
        import yaml

        return yaml.safe_load(path.read_text())
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            records = list(csv.DictReader(f))
        return {column: [r[column] for r in records] for column in records[0]}
    if path.suffix == ".jsonl" or path.name.endswith(".jsonl.gz"):
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(path.read_text())


def select(x: Any, keys: list[str], path: tuple = ()) -> list[tuple[tuple, Any]]:
    """(key path, value) of each value a key path names (globs; a list's records by a string field)."""
    if not keys:
        return [(path, x)]
    key, rest = keys[0], keys[1:]
    if isinstance(x, dict):
        children = [(k, v) for k, v in x.items() if fnmatch.fnmatchcase(str(k), key)]
    elif isinstance(x, list) and re.fullmatch(r"-?\d+", key):
        children = [(int(key) % len(x), x[int(key)])] if -len(x) <= int(key) < len(x) else []
    elif isinstance(x, list):
        children = [(i, item) for i, item in enumerate(x) if key == "*" or named(item, key)]
    else:
        children = []
    return [found for k, child in children for found in select(child, rest, (*path, k))]


def named(item: Any, key: str) -> bool:
    return isinstance(item, dict) and any(isinstance(v, str) and fnmatch.fnmatchcase(v, key) for v in item.values())


def numbers(x: Any) -> list[float]:
    """Every number a value holds, those its strings write included."""
    if isinstance(x, bool) or x is None:
        return []
    if isinstance(x, (int, float)):
        return [float(x)]
    if isinstance(x, str):
        return [value(m.group()) for m in NUMBER.finditer(x)]
    return [v for item in (x.values() if isinstance(x, dict) else x) for v in numbers(item)]


def _code_values(tree: ast.Module, key: str) -> list[float]:
    if key == "__doc__":
        return numbers(ast.get_docstring(tree) or "")
    nodes: list[ast.AST] = [tree]
    if key.startswith("--"):  # an option: its add_argument call
        calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "add_argument"]
        nodes = [c for c in calls if key in [getattr(a, "value", None) for a in c.args]]
    for part in [] if key.startswith("--") else key.split("."):
        nodes = [child for node in nodes for child in _named_in(node, part)]
    bare = {id(s.value) for node in nodes for s in ast.walk(node) if isinstance(s, ast.Expr)}  # docstrings
    out = []
    for sub in (s for node in nodes for s in ast.walk(node)):
        if isinstance(sub, ast.Constant) and id(sub) not in bare and isinstance(sub.value, (int, float, str)):
            out += numbers(sub.value)
        elif isinstance(sub, ast.UnaryOp) and isinstance(sub.op, ast.USub) and isinstance(sub.operand, ast.Constant):
            out += [-v for v in numbers(sub.operand.value) if not isinstance(sub.operand.value, str)]
    return out


def _named_in(node: ast.AST, name: str) -> list[ast.AST]:
    """What ``name`` names in a node: a definition in its body (of ``A, B = 1, 2``, the value of ``name`` alone),
    else a parameter's default, else a literal table's entry (a dict's value, a call whose first argument it is)."""
    body = node.body if isinstance(getattr(node, "body", None), list) else []  # type: ignore[attr-defined]
    out = [stmt for stmt in body if getattr(stmt, "name", None) == name]  # a def or a class
    for stmt in (stmt for stmt in body if isinstance(stmt, (ast.Assign, ast.AnnAssign))):
        for target in getattr(stmt, "targets", [getattr(stmt, "target", None)]):
            names = [getattr(t, "id", None) for t in getattr(target, "elts", [target])]
            pair = isinstance(target, ast.Tuple) and len(getattr(stmt.value, "elts", [])) == len(names)
            out += [stmt.value.elts[names.index(name)] if pair else stmt] if name in names else []  # type: ignore
    args = getattr(node, "args", None)
    if not out and isinstance(args, ast.arguments):
        positional = args.posonlyargs + args.args
        pairs = [*zip(positional[len(positional) - len(args.defaults) :], args.defaults)]
        out = [d for a, d in [*pairs, *zip(args.kwonlyargs, args.kw_defaults)] if a.arg == name and d is not None]
    is_name = lambda c: isinstance(c, ast.Constant) and isinstance(c.value, str) and fnmatch.fnmatchcase(c.value, name)
    for sub in ast.walk(node) if not out and not isinstance(node, ast.Module) else []:
        out += [v for k, v in zip(sub.keys, sub.values) if is_name(k)] if isinstance(sub, ast.Dict) else []
        out += [sub] if isinstance(sub, ast.Call) and sub.args and is_name(sub.args[0]) else []
    return out
