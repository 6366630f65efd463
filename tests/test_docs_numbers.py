"""Every number in README.md and docs/*.md (prose, lists, block quotes, code blocks and tables) comes from the
results file, recipe or code that its page cites.

**Where citations go.** A page cites its sources in HTML comments. A comment governs the lines below it, up to the
next comment or the next heading; a heading is governed by the first comment of the section it opens:

    <!-- numbers: docs/results/step_time.json#seconds_per_step #ratios.*.median -->

**A citation** is a file and a key path into it, ``.``-separated keys or list indices. A key may be a glob (``*``:
any one, ``slowrank-*``), and in a list of records a key that is not an index selects the records with a string
field equal to it (``cells.exp-real.arms.ignore_c2.vs_dgd``: the arm named ``ignore_c2``; in a ``.jsonl`` or
``.jsonl.gz`` file of run records, a record by its ``job``). ``#key`` reads the file of the citation before it,
and ``.a.b`` its key with its last keys replaced (as many as given). The sources:

- a results file: ``.json``, ``.jsonl`` and ``.jsonl.gz`` (a list of records), ``.csv`` (by column);
- a recipe (``.yaml``, by key path);
- code (``.py``): a top-level function, class or constant; a dotted name inside one (``PGCStrategy.__init__``); a
  parameter's default (``PGCStrategy.__init__.timeout``); an entry of a literal table (``COSTS.comm``: a dict's
  value, or the call whose first argument is that name); a command-line option (``--steps``: its
  ``add_argument`` call); ``__doc__`` (a script's docstring: the commands it documents). Its numbers are its
  numeric literals and the numbers its strings write (an error message), not its comments or docstrings.

Settings and definitions are cited like results: from the constant, the recipe, the script's default or the
configuration the results file recorded.

**What backs a number.** One of the numbers the citation names, at the precision shown (``0.987`` is 0.9865 to
0.9875), never as a substring, and with no implicit rescaling (seconds are not found as milliseconds). A citation
may ask for a unit, ``@ms`` (a file's seconds shown in milliseconds), ``@min``, ``@h`` (in minutes, hours), ``@%``
(a fraction shown as a percentage); for a count, ``@count`` (how many entries the key holds: ``#arms@count``); or
for a summary of the numbers it names, before any unit: ``@mean``, ``@median``, ``@sum``, ``@least``, ``@most``
(``grid_runs/round2.jsonl.gz#main__exp-real__*.job_wall_s@sum@min``: those jobs' minutes). A number may carry a
suffix: ``x`` (a ratio, read as is), ``k`` and ``M`` (``1.7M`` is 1,700,000 to the nearest 100,000).

- **Prose and code** read their citations in order, as footnotes: the first numbers under a comment are under its
  first citation, the numbers after them under the same citation or the next one, and so on to the last, which
  must be reached. A citation that names a single number backs a single number (a list cited element by element
  reads as that list). So a changed number is caught even where another citation of the paragraph holds its new
  value. A citation bound with ``*=`` backs any number under the comment, in any order: the settings a paragraph
  keeps naming between its results (``n = 16``).
- **A table**'s first row is its header. A citation can be bound to one column (``3=docs/x.json#runs.*.val_acc``:
  the third cell of every row); a cell is checked against the citations bound to its column, or, where none is,
  against the unbound ones, as a set.

**Not checked**, and only these:

- integers below 10 (ranks, ``s``, ``c``, seeds, counts of rows: structure rather than results; a page speaks of
  "4 ranks" and "s = 1" in every paragraph, and citing each would bury the citations that matter);
- a number that is part of a name: inside a word or an identifier (``bf16-mixed``, ``float64``, ``mlp_10m``), after
  a hyphenated name (``ResNet-18``, ``CIFAR-10``), a version (``2.6.6``), a precision's name (``16-mixed``,
  ``32-true``, ``16-bit``), or a glob's character class (``seed[234]``);
- dates and clock times (``2026-12-02 18:53``), a reference's year or number (``et al. (2017)``, ``(ICML 2017)``,
  ``arXiv 2607.20739``) and a release of a dependency (``Lightning 2.6``, ``torch (2.4 or 2.5)``): they say when
  or which, not how much;
- a program a test runs as pasted (:data:`RUN_AS_PASTED`: README's example, run by tests/test_readme.py): its
  literals are the program itself;
- lines inside a block a script generates (between its begin/end markers, or a whole generated page): they are
  regenerated from their results file and compared exactly (:data:`GENERATED`, the tests at the end of this file,
  tests/test_grid_map.py, tests/test_readme.py and tests/test_layout.py). A page that mixes prose by hand with a
  generated block lists the block's markers, not ``*``: its prose is then cited like any other;
- the inside of an HTML comment, and a table's header row.

``test_every_number_changed_in_its_last_digit_is_flagged`` changes every guarded number in memory, one up and one
down in its last digit, and asserts the checker flags every change of a prose number (and all but a bounded share
of table cells, where a column can hold the changed value too).
"""

from __future__ import annotations

import ast
import bisect
import csv
import fnmatch
import functools
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted(RESULTS.glob("*.md"))]
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
CITATION = re.compile(r"<!-- numbers: (.+?) -->")
SEPARATOR = re.compile(r"^\s*\|[-:| ]+\|\s*$")
FENCE = re.compile(r"^\s*```")
QUOTE = re.compile(r"^\s*(?:>\s?)*\s*")  # a block quote's markers and the indentation

#: Programs a test runs as pasted: their literals are the program itself, not claims about it (page -> the
#: heading of the section whose code blocks they are)
RUN_AS_PASTED: dict[str, set[str]] = {"README.md": {"## A complete example"}}  # tests/test_readme.py

#: Blocks checked by exact regeneration instead: page -> the marker names of its generated blocks ("*": the page)
GENERATED: dict[str, set[str]] = {
    "README.md": {"which"},  # tests/test_readme.py
    "docs/guide.md": {"which-guide", "advise", "hard-guide"},  # tests/test_readme.py; below
    "docs/results/benchmarks.md": {"gridmap", "grid", "emulated"},  # tests/test_grid_map.py; below
    "docs/results/emulator.md": {"emulated-cost", "validation-e2e", "reduced-timing"},  # below
    "docs/results/bounded_staleness.md": {"bounded", "bounded-choice"},  # below
    "docs/results/simulation.md": {"sim", "simgrid"},  # below
    "docs/results/demo.md": {"*"},  # below
    "docs/results/tasks.md": {"*"},  # below
    "docs/results/hard_tasks.md": {"hard-map"},  # below
    "docs/results/staleness_emulated.md": {"*"},  # below
    "docs/results/staleness.md": {"*"},  # below
    "docs/results/staleness_bounded.md": {"*"},  # below
    "docs/results/staleness_exponential.md": {"*"},  # below
    "docs/results/staleness_stalls.md": {"*"},  # below
    "docs/results/safety_valve.md": {"*"},  # below
    "docs/results/step_time.md": {"*"},  # below
    "docs/results/step_time_planes.md": {"*"},  # below
    "docs/results/step_time_passes.md": {"*"},  # below
    "docs/results/gpu_check.md": {"*"},  # below
    "docs/results/rejoin.md": {"*"},  # below
    "docs/results/auto.md": {"*"},  # below
    "docs/results/memory.md": {"*"},  # below
    "docs/results/stall.md": {"*"},  # below
    "docs/math.md": {"table:| n | s | C(n,s) |"},  # its rows, below
    "docs/design.md": {"module-map"},  # tests/test_layout.py
}


def value(token: str) -> float:
    """The number a token (as :data:`NUMBER` matches it) stands for."""
    match = NUMBER.fullmatch(token)
    if not match:
        raise ValueError(f"not a number: {token!r}")
    return float(match["core"]) * SCALE[match["suffix"] or ""]


def is_checked(token: str) -> bool:
    """Integers below 10 are structure, not results (see the module's docstring)."""
    core = NUMBER.fullmatch(token)["core"]  # type: ignore[index]
    return "." in core or "e" in core.lower() or abs(value(token)) >= 10


def numbers_in(line: str) -> list[re.Match[str]]:
    """The checked numbers of one line of a page, as matches into it (code spans read as text; dates, clock times
    and a reference's year masked)."""
    masked = NOT_A_QUANTITY.sub(lambda m: " " * len(m.group()), line.replace("`", " "))
    return [m for m in NUMBER.finditer(masked) if is_checked(m.group())]


def generated_lines(text: str, names: set[str]) -> set[int]:
    """1-based line numbers inside the generated blocks ``names`` of a page."""
    lines = text.splitlines()
    if "*" in names:
        return set(range(1, len(lines) + 1))
    inside, out = False, set()
    for header in (name[len("table:") :] for name in names if name.startswith("table:")):
        first = next(k for k, line in enumerate(lines, 1) if line.startswith(header))
        out.add(first)
    for k, line in enumerate(lines, 1):
        if any(line.startswith(f"<!-- {name}:begin") for name in names):
            inside = True
        if inside:
            out.add(k)
        if any(line.startswith(f"<!-- {name}:end") for name in names):
            inside = False
    return out


@dataclass(frozen=True)
class Governed:
    """One line of a page that holds checked numbers: how it is read and what governs it."""

    line: int  # 1-based
    text: str
    column_cells: bool  # a table's body row: each number is bound to its cell's column
    cited: str  # the citations of the comment that governs it ("": none)
    comment: int  # the line of that comment (0: none)


def governed_lines(where: str, text: str) -> list[Governed]:
    """Every line of a page whose numbers are checked, with the citations that govern it: the last comment above
    it in its section (heading to heading), or, for a heading, the first comment of the section it opens."""
    lines = text.splitlines()
    skip = generated_lines(text, GENERATED.get(where, set()))
    kinds: list[str] = []  # per line: fence, code, comment, heading, header, separator, row (a table's body), text
    in_code = in_comment = False
    for line in lines:
        if FENCE.match(line):
            in_code = not in_code
            kinds.append("fence")
        elif in_code:
            kinds.append("code")
        elif in_comment or QUOTE.sub("", line).startswith("<!--"):
            in_comment = "-->" not in line
            kinds.append("comment")
        elif line.startswith("#"):
            kinds.append("heading")
        elif line.lstrip().startswith("|"):
            first = not kinds or kinds[-1] not in ("row", "header", "separator")
            kinds.append("separator" if SEPARATOR.match(line) else "header" if first else "row")
        else:
            kinds.append("text")
    pasted, heading = set(), ""
    for k, (line, kind) in enumerate(zip(lines, kinds), 1):
        heading = line if kind == "heading" else heading
        if kind == "code" and heading in RUN_AS_PASTED.get(where, set()):
            pasted.add(k)
    skip |= pasted
    out: list[Governed] = []
    section: list[int] = []  # the lines of the current section
    comments: dict[int, str] = {}

    def close() -> None:
        marks = sorted(comments)
        for k in section:
            line, kind = lines[k - 1], kinds[k - 1]
            if k in skip or kind in ("fence", "comment", "header", "separator") or not numbers_in(line):
                continue
            above = marks[:1] if kind == "heading" else [m for m in marks if m < k][-1:]
            out.append(Governed(k, line, kind == "row", comments[above[0]] if above else "", above[0] if above else 0))

    for k, (line, kind) in enumerate(zip(lines, kinds), 1):
        if kind == "heading":
            close()
            section, comments = [], {}
        section.append(k)
        found = CITATION.findall(line) if kind != "code" else []
        if found:
            comments[k] = found[-1]
    close()
    return out


def column_of(line: str, position: int) -> int:
    """The 1-based table column of the character at ``position`` of a table row."""
    indent = len(line) - len(line.lstrip())
    return line.lstrip()[: position - indent].count(" | ") + 1


def citations(cited: str) -> list[tuple[int, str]]:
    """(column, ``file#key``) of each citation of a comment (column 0: not bound; -1: ``*=``, anywhere in the
    prose). ``#key`` reads the file of the citation before it; ``.a.b`` its key with the last keys replaced (as many
    as given)."""
    out, last = [], ""
    for item in cited.split():
        column, rest = item.split("=", 1) if re.match(r"(\d+|\*)=", item) else ("0", item)
        column = "-1" if column == "*" else column
        if rest.startswith("."):
            name, _, key = last.partition("#")
            tail = rest[1:].split(".")
            keys = key.split(".")
            if not last or len(tail) > len(keys):
                raise ValueError(f"{item}: no citation before it with {len(tail)} keys to replace")
            rest = f"{name}#" + ".".join(keys[: len(keys) - len(tail)] + tail)
        elif rest.startswith("#"):
            rest = last.partition("#")[0] + rest
        last = rest
        out.append((int(column), rest))
    return out


#: The units a citation may ask for (``file#key@ms``): the factor from the unit its file keeps the numbers in
UNITS = {"ms": 1e3, "%": 1e2, "min": 1 / 60, "h": 1 / 3600}


#: What a citation may ask of the numbers it names (``file#key@mean``), before a unit: one number
SUMMARIES: dict[str, Any] = {
    "mean": lambda v: sum(v) / len(v),
    "median": lambda v: sorted(v)[len(v) // 2] if len(v) % 2 else sum(sorted(v)[len(v) // 2 - 1 : len(v) // 2 + 1]) / 2,
    "sum": sum,
    "least": min,
    "most": max,
}


@functools.lru_cache(maxsize=None)
def _sorted_values(citation: str) -> list[float]:
    citation, *asks = citation.split("@")
    values = [v for v in cited_numbers(citation) if math.isfinite(v)]
    for ask in asks:
        if ask == "count":
            values = [float(count_of(citation))]
        elif ask in SUMMARIES:
            values = [float(SUMMARIES[ask](values))]
        elif ask in UNITS:
            values = [v * UNITS[ask] for v in values]
        else:
            raise ValueError(f"{citation}@{ask}: ask for count, {', '.join(SUMMARIES)} or a unit ({', '.join(UNITS)})")
    return sorted(values)


@functools.lru_cache(maxsize=None)
def values_by_column(cited: str) -> dict[int, list[float]]:
    """Column (0: every column without its own citation) -> the numbers cited for it, sorted."""
    out: dict[int, list[float]] = {}
    for column, citation in citations(cited):
        out.setdefault(column, []).extend(_sorted_values(citation))
    return {column: sorted(values) for column, values in out.items()}


@functools.lru_cache(maxsize=None)
def prose_sources(cited: str) -> list[list[float]]:
    """The numbers of each unbound citation of a comment, in the comment's order."""
    return [_sorted_values(citation) for column, citation in citations(cited) if column == 0]


@functools.lru_cache(maxsize=None)
def prose_anywhere(cited: str) -> list[float]:
    """The numbers of a comment's ``*=`` citations: the settings its prose keeps naming (``n = 16``), in any order."""
    return sorted(v for column, citation in citations(cited) if column == -1 for v in _sorted_values(citation))


@dataclass(frozen=True)
class Number:
    """One checked number of a page."""

    line: int
    start: int  # its offset in the line
    token: str
    column: int  # its table column; 0 in prose
    cited: str
    comment: int  # the line of the comment that governs it (0: none)


def numbers_of(item: Governed) -> list[Number]:
    return [
        Number(
            item.line,
            m.start(),
            m.group(),
            column_of(item.text, m.start()) if item.column_cells else 0,
            item.cited,
            item.comment,
        )
        for m in numbers_in(item.text)
    ]


def page_numbers(where: str, text: str) -> list[Number]:
    """Every checked number of a page outside its generated blocks."""
    return [number for item in governed_lines(where, text) for number in numbers_of(item)]


def out_of_order(tokens: list[str], sources: list[list[float]]) -> tuple[list[int], bool]:
    """Prose reads its citations in order: the first numbers are under the first citation, the numbers after them
    under the same citation or the next one, and so on to the last; a citation that names one number backs one
    number (a list cited element by element reads as that list). Returns the indices of the tokens that break
    this (each under neither the citation of the number before it nor the next one), and whether the last
    citations were left unused."""
    wrong: list[int] = []
    reach = {-1}  # the citations the number before may have been under (-1: none yet)
    for i, token in enumerate(tokens):
        nexts = {j for r in reach for j in ((r, r + 1) if r >= 0 and len(sources[r]) > 1 else (r + 1,))}
        step = {j for j in nexts if 0 <= j < len(sources) and _within(token, sources[j])}
        if not step:
            wrong.append(i)  # read on from the first citation at or after this point that has it, if any
            later = [j for j in range(max(min(reach), 0), len(sources)) if _within(token, sources[j])]
            step = {later[0]} if later else reach
        reach = step
    return wrong, len(sources) - 1 not in reach


@dataclass(frozen=True)
class Problem:
    line: int
    start: int
    token: str
    cited: str
    why: str

    def __str__(self) -> str:
        return f"{self.line}: {self.token}: {self.why}" + (f" [{self.cited}]" if self.cited else "")


def problems(numbers: list[Number]) -> list[Problem]:
    """The checker: the numbers not under the citations that govern them (prose in the citations' order)."""
    out = []
    runs: dict[int, list[Number]] = {}
    for n in numbers:
        if not n.cited:
            out.append(
                Problem(n.line, n.start, n.token, "", "no <!-- numbers: file#key ... --> above it in its section")
            )
        elif n.column:
            if not _within(n.token, values_by_column(n.cited).get(n.column, values_by_column(n.cited).get(0, []))):
                out.append(Problem(n.line, n.start, n.token, n.cited, f"column {n.column} not under its citations"))
        else:
            runs.setdefault(n.comment, []).append(n)
    for run in runs.values():
        sources, anywhere = prose_sources(run[0].cited), prose_anywhere(run[0].cited)
        run = [n for n in run if not _within(n.token, anywhere)]
        if not run:
            continue
        wrong, unused = out_of_order([n.token for n in run], sources)
        for i in wrong:
            n = run[i]
            out.append(Problem(n.line, n.start, n.token, n.cited, "not under its citation, nor the next one"))
        if unused and not wrong:
            last = run[-1]
            why = f"the last of {len(sources)} citations are not reached by the numbers under comment {last.comment}"
            out.append(Problem(last.line, last.start, last.token, last.cited, why))
    return sorted(out, key=lambda p: (p.line, p.start))


def page_problems(where: str, text: str) -> list[Problem]:
    return problems(page_numbers(where, text))


def _numbers(x: Any, out: list[float]) -> None:
    if isinstance(x, bool) or x is None:
        return
    if isinstance(x, (int, float)):
        out.append(float(x))
    elif isinstance(x, dict):
        for v in x.values():
            _numbers(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _numbers(v, out)
    elif isinstance(x, str):
        out.extend(value(m.group()) for m in NUMBER.finditer(x))


def _is_pattern(key: str) -> bool:
    return any(ch in key for ch in "*?[")


def _named(item: Any, key: str) -> bool:
    """A record of a list is selected by name: one of its string fields is ``key`` (a glob)."""
    return isinstance(item, dict) and any(isinstance(v, str) and fnmatch.fnmatchcase(v, key) for v in item.values())


def _select(x: Any, keys: list[str]) -> list[Any]:
    if not keys:
        return [x]
    key, rest = keys[0], keys[1:]
    if isinstance(x, dict):
        if _is_pattern(key):
            children = [v for k, v in x.items() if fnmatch.fnmatchcase(str(k), key)]
        else:
            children = [x[key]] if key in x else []
    elif isinstance(x, list):
        if key.lstrip("-").isdigit():
            children = [x[int(key)]] if -len(x) <= int(key) < len(x) else []
        else:
            children = [item for item in x if key == "*" or _named(item, key)]
    else:
        children = []
    return [found for child in children for found in _select(child, rest)]


def _resolve(name: str) -> Path:
    for candidate in (ROOT / name, DOCS / name, RESULTS / name, ROOT / "recipes" / name):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(name)


def _defines(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        names = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        return any(isinstance(t, ast.Name) and t.id == name for t in names)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False


def _python_nodes(tree: ast.Module, key: str) -> list[ast.AST]:
    """A top-level name, a dotted name inside one (``Class.method``), or an option's ``add_argument`` call."""
    if key.startswith("--"):
        return [
            call
            for call in ast.walk(tree)
            if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "add_argument"
            and any(isinstance(a, ast.Constant) and a.value == key for a in call.args)
        ]
    nodes: list[ast.AST] = []
    body: list[ast.stmt] = tree.body
    for part in key.split("."):
        nodes = (
            [_value_of(n, part) for n in body if _defines(n, part)]
            or [default for n in nodes for default in _default_of(n, part)]
            or [entry for n in nodes for entry in _entries(n, part)]
        )
        body = [child for n in nodes for child in getattr(n, "body", [])]
    return nodes


def _entries(node: ast.AST, name: str) -> list[ast.AST]:
    """In a literal table, the entry named ``name``: a dict's value under that key, or a call whose first argument
    is that string (``COSTS.comm``: the ``Cost("comm", ...)`` of ``COSTS``)."""
    out: list[ast.AST] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Dict):
            out += [v for k, v in zip(sub.keys, sub.values) if isinstance(k, ast.Constant) and _is(k.value, name)]
        elif isinstance(sub, ast.Call) and sub.args and isinstance(sub.args[0], ast.Constant):
            out += [sub] if _is(sub.args[0].value, name) else []
    return out


def _is(value: Any, name: str) -> bool:
    """A string ``value`` is ``name`` (a glob: ``one?slow?rank`` names ``"one slow rank"``)."""
    return isinstance(value, str) and fnmatch.fnmatchcase(value, name)


def _default_of(node: ast.AST, name: str) -> list[ast.AST]:
    """The default of a function's parameter ``name`` (``PGCStrategy.__init__.timeout``)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    a = node.args
    positional = a.posonlyargs + a.args
    pairs = list(zip(positional[len(positional) - len(a.defaults) :], a.defaults))
    pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
    return [default for arg, default in pairs if arg.arg == name]


def _value_of(node: ast.stmt, name: str) -> ast.AST:
    """A definition, or of ``A, B = 1, 2`` the value of ``name`` alone."""
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
        for target in node.targets:
            if isinstance(target, ast.Tuple) and len(target.elts) == len(node.value.elts):
                for element, value in zip(target.elts, node.value.elts):
                    if isinstance(element, ast.Name) and element.id == name:
                        return value
    return node


def _literals(node: ast.AST) -> list[float]:
    """The numeric literals under ``node``, and the numbers its strings write (an error message's text), but not
    its docstrings (nor its comments, which the parser drops)."""
    docstrings = {
        id(body[0].value)
        for sub in ast.walk(node)
        for body in [getattr(sub, "body", None)]
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    }
    values: list[float] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, (int, float)) and not isinstance(sub.value, bool):
            values.append(float(sub.value))
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and id(sub) not in docstrings:
            values.extend(value(m.group()) for m in NUMBER.finditer(sub.value))
        elif (
            isinstance(sub, ast.UnaryOp)
            and isinstance(sub.op, ast.USub)
            and isinstance(sub.operand, ast.Constant)
            and isinstance(sub.operand.value, (int, float))
        ):
            values.append(-float(sub.operand.value))
    return values


def cited_numbers(citation: str) -> list[float]:
    """The numbers one citation (``file#key``) names; raises if the file or the key does not exist."""
    name, _, key = citation.partition("#")
    if not key:
        raise ValueError(f"{citation}: cite a key (file#key), not a whole file")
    path = _resolve(name)
    values: list[float] = []
    if path.suffix == ".py" and key == "__doc__":  # a script's docstring: the commands it documents
        _numbers(ast.get_docstring(ast.parse(path.read_text())) or "", values)
        return values
    if path.suffix == ".py":
        nodes = _python_nodes(ast.parse(path.read_text()), key)
        if not nodes:
            raise KeyError(f"{citation}: no {key} in {name}")
        return [v for node in nodes for v in _literals(node)]
    data = _load(path)
    if path.suffix == ".csv":
        rows = [row[key] for row in data if key in row]
        if not rows:
            raise KeyError(f"{citation}: no column {key} in {name}")
        _numbers(rows, values)
        return values
    found = _select(data, key.split("."))
    if not found:
        raise KeyError(f"{citation}: no key {key} in {name}")
    _numbers(found, values)
    return values


def count_of(citation: str) -> int:
    """``file#key@count``: how many entries the key names (one list or dict: its length; a glob: its matches)."""
    name, _, key = citation.partition("#")
    found = _select(_load(_resolve(name)), key.split("."))
    if not found:
        raise KeyError(f"{citation}: no key {key} in {name}")
    return len(found[0]) if len(found) == 1 and isinstance(found[0], (list, dict)) else len(found)


@functools.lru_cache(maxsize=None)
def _load(path: Path) -> Any:
    """A results file or recipe, read once."""
    if path.suffix == ".yaml":
        import yaml

        return yaml.safe_load(path.read_text())
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    if path.suffix == ".jsonl" or path.name.endswith(".jsonl.gz"):
        import gzip

        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(path.read_text())


def _tolerance(token: str) -> tuple[float, float]:
    """(the value shown, half its last digit)."""
    match = NUMBER.fullmatch(token)
    if not match:
        raise ValueError(f"not a number: {token!r}")
    core, scale = match["core"].lower(), SCALE[match["suffix"] or ""]
    shown = float(core) * scale
    mantissa, _, exponent = core.partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    unit = 10.0 ** (int(exponent) if exponent else 0) * scale
    return shown, 0.5 * 10.0 ** (-decimals) * unit * 1.0001


def matches(token: str, value: float) -> bool:
    """``value`` shown at the precision of ``token`` is ``token``."""
    shown, half = _tolerance(token)
    return (shown != 0 or "e" not in token.lower()) and abs(value - shown) <= half


def _within(token: str, ordered: list[float]) -> bool:
    """Some value of the sorted list ``ordered``, shown at the precision of ``token``, is ``token``."""
    shown, half = _tolerance(token)
    i = bisect.bisect_left(ordered, shown - half)
    return i < len(ordered) and ordered[i] <= shown + half and matches(token, ordered[i])


def backed(token: str, values: list[float]) -> bool:
    return _within(token, sorted(values))


def _relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_every_number_of_a_page_is_under_the_keys_its_comment_cites(page: Path) -> None:
    where = _relative(page)
    wrong = [f"{where}:{p}" for p in page_problems(where, page.read_text())]
    assert not wrong, "\n".join(wrong)


def test_the_checker_catches_a_wrong_number(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "r.json").write_text(json.dumps({"a": 0.98667, "b": [12.34, 2.0e-5], "c": {"ms": 1234.0}}))
    a = cited_numbers("r.json#a")
    assert backed("0.987", a) and not backed("0.988", a) and not backed("12.3", a)  # only the cited key
    b = cited_numbers("r.json#b")
    assert backed("12.3", b) and backed("2e-05", b) and not backed("12.4", b) and not backed("3e-05", b)
    assert not backed("1.234", cited_numbers("r.json#c.ms")) and not backed("12340", b)  # no rescaling
    assert cited_numbers("r.json#b.1") == [2.0e-5] and cited_numbers("r.json#*") == [0.98667, 12.34, 2.0e-5, 1234.0]
    assert backed("1.2k", cited_numbers("r.json#c.ms")) and not backed("1.3k", cited_numbers("r.json#c.ms"))
    assert _within("20.6", _sorted_values("r.json#c.ms@min")) and _within("98.7", _sorted_values("r.json#a@%"))
    assert not _within("1234", _sorted_values("r.json#c.ms@ms")) and _within(
        "1234000", _sorted_values("r.json#c.ms@ms")
    )
    assert _sorted_values("r.json#b@count") == [2.0] and _sorted_values("r.json#*@count") == [3.0]
    assert _sorted_values("r.json#b@most") == [12.34] and _within("20.8", _sorted_values("r.json#*@sum@min"))
    with pytest.raises(KeyError):
        cited_numbers("r.json#d")
    with pytest.raises(ValueError, match="cite a key"):
        cited_numbers("r.json")
    (tmp_path / "t.py").write_text(
        "'Run it with --scale 0.001.'\nLIMIT = 0.25\nSTEPS, TARGET = 120, 0.3\n\n\ndef f():\n    '1.25 in a docstring'\n    assert g() < 1.5  # 7.75 in a comment\n"
        "    raise ValueError(f'lost {d} of 16 digits', 'v2.125', -3.5)\n\n\n"
        "class K:\n    def m(self, x=12.5, *, y=0.75):\n        return 2.75\n\n\n"
        "p.add_argument('--steps', type=int, default=200)\np.add_argument('--lr', type=float, default=0.1)\n"
        "TABLE = {'a': 1.25, 'b': Cost('c', 2.5, note='17 MB')}\n"
    )
    f = cited_numbers("t.py#f")
    assert backed("1.5", f) and backed("-3.5", f) and not backed("0.25", f)  # LIMIT is not in f
    assert not backed("7.75", f) and not backed("2.125", f) and not backed("1.6", f)  # no comment, no substring
    assert backed("16", f) and not backed("1.25", f)  # a message's text, not a docstring
    assert cited_numbers("t.py#__doc__") == [0.001] and not backed("0.001", cited_numbers("t.py#LIMIT"))
    assert backed("0.25", cited_numbers("t.py#LIMIT")) and sorted(cited_numbers("t.py#K.m")) == [0.75, 2.5, 12.5][
        :0
    ] + [0.75, 2.75, 12.5]
    assert cited_numbers("t.py#K.m.x") == [12.5] and cited_numbers("t.py#K.m.y") == [0.75]
    assert cited_numbers("t.py#TARGET") == [0.3] and cited_numbers("t.py#--steps") == [200.0]
    assert (
        cited_numbers("t.py#TABLE.a") == [1.25]
        and sorted(cited_numbers("t.py#TABLE.c")) == [2.5, 17.0]
        and not backed("200", cited_numbers("t.py#--lr"))
    )
    (tmp_path / "runs.json").write_text(
        json.dumps({"cells": {"slow-a": {"arms": [{"arm": "gc_c2", "x": 0.51}, {"arm": "pgc_c2", "x": 0.73}]}}})
    )
    assert cited_numbers("runs.json#cells.slow-*.arms.pgc_c2.x") == [0.73]  # a glob, a record by its name
    assert cited_numbers("runs.json#cells.*.arms.*_c2.x") == [0.51, 0.73]
    page = (
        "# t\n\n<!-- numbers: r.json#a 3=r.json#b -->\n\n| x | y | z |\n|---|---|---|\n| a | 0.988 | 12.3 |\n"
        "| b | 16-mixed | 0.987 |\n\nProse under it reads the unbound 0.987, then 0.988.\n\n"
        "## s, 12 ranks\n\n<!-- numbers: runs.json#cells.slow-a.arms.gc_c2 #cells.slow-a.arms.pgc_c2.x r.json#a -->\n\n"
        "- took 0.51x-0.73x, then 0.74x (ResNet-18, bf16-mixed, v2.6.6, 2026-12-02 18:53, run 3)\n"
        "```bash\npython x.py --lr 0.987 --lr 0.51\n```\n\n## no comment\n\nA 120-step run.\n"
    )
    wrong = [(p.line, p.token) for p in page_problems("t.md", page)]
    assert wrong == [(7, "0.988"), (8, "0.987"), (10, "0.988"), (12, "12"), (16, "0.74x"), (18, "0.51"), (23, "120")]
    ordered = "<!-- numbers: r.json#c.ms r.json#b -->\n1234 and 12.3, 2e-05, 12.3, 1234.0\n"
    assert [str(p) for p in page_problems("t.md", ordered)] == [
        "2: 1234.0: not under its citation, nor the next one [r.json#c.ms r.json#b]"
    ]
    assert [p.token for p in page_problems("t.md", "<!-- numbers: r.json#a #b.0 -->\n0.987, 0.987, 12.3\n")] == [
        "0.987"  # a citation of one number backs one number
    ]
    anywhere = "<!-- numbers: *=r.json#c.ms r.json#a #b.0 -->\n1234: 0.987 (1234), 12.3 (1234); 0.988\n"
    assert [p.token for p in page_problems("t.md", anywhere)] == ["0.988"]
    quoted = "> <!-- numbers: r.json#a -->\n> - took 0.987 (ResNet-18, Lightning 2.6, torch (2.4 or 2.5), seed[234])\n"
    assert page_numbers("t.md", quoted)[0].token == "0.987" and not page_problems("t.md", quoted)
    tokens = [m.group() for m in numbers_in("`--lr 0.05`, 0.79x-0.81x, 38k, 1.7M, -3.5, 5 %, 12. 1x1 arXiv 2607.20739")]
    assert tokens == ["0.05", "0.79x", "0.81x", "38k", "1.7M", "-3.5", "12"]
    assert value("38k") == 38000 and value("1.7M") == 1.7e6 and backed("1.7M", [1707722.0])
    assert citations("a.json#x.y.z #u.p .v .w.t 2=.s") == [
        (0, "a.json#x.y.z"),
        (0, "a.json#u.p"),
        (0, "a.json#u.v"),
        (0, "a.json#w.t"),
        (2, "a.json#w.s"),
    ]
    assert [p.why[:30] for p in page_problems("t.md", "<!-- numbers: r.json#a r.json#c.ms -->\n0.987\n")] == [
        "the last of 2 citations are no"
    ]


def _last_digit_changed(token: str, delta: int) -> str:
    """``token`` with its last digit moved by ``delta`` (carrying), or "" when that changes its length."""
    match = NUMBER.fullmatch(token)
    assert match, token
    mantissa, _, exponent = match["core"].lower().partition("e")
    sign = mantissa[: len(mantissa) - len(mantissa.lstrip("+-"))]
    digits = mantissa[len(sign) :]
    body = digits.replace(".", "")
    if int(body) + delta < 0 or len(str(int(body) + delta).rjust(len(body), "0")) != len(body):
        return ""
    changed = str(int(body) + delta).rjust(len(body), "0")
    point = digits.find(".")
    if point >= 0:
        changed = changed[:point] + "." + changed[point:]
    if re.match(r"0\d", changed):  # 10 -> 09 is not how a number is written
        return ""
    return sign + changed + (f"e{exponent}" if exponent else "") + (match["suffix"] or "")


@dataclass
class Tally:
    """One page's perturbations: numbers guarded, changes tried, changes the checker missed; prose (and code)
    apart from table cells."""

    prose: int = 0
    cells: int = 0
    prose_tried: int = 0
    cells_tried: int = 0
    prose_missed: list[str] = field(default_factory=list)
    cells_missed: list[str] = field(default_factory=list)


def perturbations() -> dict[str, Tally]:
    """Every guarded number of every page, changed in memory in its last digit one up and one down (where that
    keeps its length), its line read again and checked with the numbers it is checked with: its table cell
    alone, or every number under its prose comment. A changed number moves no comment, so what governs each
    line is unchanged."""
    out = {}
    for page in PAGES:
        where, tally = _relative(page), Tally()
        items = governed_lines(where, page.read_text())
        numbers = [n for item in items for n in numbers_of(item)]
        assert not problems(numbers), where
        runs: dict[int, list[Number]] = {}
        for n in numbers:
            if not n.column:
                runs.setdefault(n.comment, []).append(n)
        for item in items:
            for n in numbers_of(item):
                tally.cells += bool(n.column)
                tally.prose += not n.column
                for delta in (1, -1):
                    changed = _last_digit_changed(n.token, delta)
                    if not changed:
                        continue
                    edited = item.text[: n.start] + changed + item.text[n.start + len(n.token) :]
                    again = numbers_of(Governed(item.line, edited, item.column_cells, item.cited, item.comment))
                    if n.column:
                        checked = [m for m in again if m.start == n.start]
                    else:
                        run = runs[n.comment]
                        checked = [m for m in run if m.line < n.line] + [m for m in again if not m.column]
                        checked += [m for m in run if m.line > n.line]
                    missed = [] if problems(checked) else [f"{where}:{n.line}: {n.token} -> {changed} [{n.cited}]"]
                    if n.column:
                        tally.cells_tried += 1
                        tally.cells_missed += missed
                    else:
                        tally.prose_tried += 1
                        tally.prose_missed += missed
        out[where] = tally
    return out


def test_every_number_changed_in_its_last_digit_is_flagged() -> None:
    """Every change of a prose (or code) number is flagged. A table cell is checked against the column's
    citations as a set, so a change passes where the changed value is itself in its column (a column of nearby
    values); the share of such coincidences is bounded."""
    assert _last_digit_changed("0.987", 1) == "0.988" and _last_digit_changed("12", -1) == "11"
    assert _last_digit_changed("2e-05", 1) == "3e-05" and _last_digit_changed("1.0", -1) == "0.9"
    assert _last_digit_changed("-0.25", 1) == "-0.26" and _last_digit_changed("9", 1) == ""
    assert _last_digit_changed("0.79x", 1) == "0.80x" and _last_digit_changed("10", -1) == ""
    tallies = perturbations().values()
    prose, tried = sum(t.prose for t in tallies), sum(t.prose_tried for t in tallies)
    missed = [m for t in tallies for m in t.prose_missed]
    assert prose >= 1800 and tried >= 2 * prose - 300
    assert not missed, f"{len(missed)} of {tried} changed prose numbers pass the checker:\n" + "\n".join(missed[:50])
    cells, cells_missed = sum(t.cells_tried for t in tallies), [m for t in tallies for m in t.cells_missed]
    assert cells >= 200 and len(cells_missed) / cells < 0.1, f"{len(cells_missed)} of {cells}: {cells_missed[:20]}"


def test_a_whole_page_changed_is_flagged_where_its_line_alone_is() -> None:
    """The perturbation test checks a changed number with those it is checked with; on a seeded sample, the
    checker run on the whole changed page flags it too."""
    import random

    rng = random.Random(0)
    for page in PAGES:
        where, text = _relative(page), page.read_text()
        numbers = page_numbers(where, text)
        for n in rng.sample(numbers, min(5, len(numbers))):
            lines = text.splitlines()
            changed = _last_digit_changed(n.token, 1) or _last_digit_changed(n.token, -1)
            line = lines[n.line - 1]
            lines[n.line - 1] = line[: n.start] + changed + line[n.start + len(n.token) :]
            assert page_problems(where, "\n".join(lines)), f"{where}:{n.line}: {n.token} -> {changed}"


def test_benchmarks_block_is_what_grid_renders_from_benchmarks_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import grid

    result = json.loads((RESULTS / "benchmarks.json").read_text())
    text = (RESULTS / "benchmarks.md").read_text()
    block = text[text.index(grid.MARK_BEGIN) : text.index(grid.MARK_END) + len(grid.MARK_END)]
    assert block == grid.render_markdown(result, result["table"])


def test_demo_page_is_what_the_demo_renders_from_demo_json() -> None:
    from pgc_lab import demo

    saved = json.loads((RESULTS / "demo.json").read_text())
    args = demo.parse_args([])
    args.__dict__.update(saved["settings"])
    outcomes = demo.read_outcomes(saved["results"])
    assert demo.page(outcomes, args, saved["command"]) == (RESULTS / "demo.md").read_text()


def test_staleness_emulated_page_is_what_its_script_renders_from_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import staleness_emulated as se

    summary = json.loads((RESULTS / "staleness_emulated.json").read_text())
    assert se.render(summary) == (RESULTS / "staleness_emulated.md").read_text()
    assert se.summarize(se.read_records(se.RECORDS)) == summary  # the summary is the records'


def test_tasks_page_is_what_its_script_renders_from_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import task_sensitivity as ts

    results = json.loads((RESULTS / "task_sensitivity.json").read_text())
    assert ts.render(results) == (RESULTS / "tasks.md").read_text()


def test_math_conditioning_table_is_tandon_conditions_json() -> None:
    saved = json.loads((RESULTS / "tandon_conditions.json").read_text())
    text = (DOCS / "math.md").read_text()
    table = text[text.index("| n | s | C(n,s) |") :].split("\n\n")[0].splitlines()
    assert len(table) == 2 + len(saved["rows"])  # header, separator, one line per saved row: nothing else
    for row in saved["rows"]:
        cells = [
            str(row["n"]),
            str(row["s"]),
            str(row["subsets_total"]),
            "all" if row["exact"] else f"{row['subsets_checked']} sampled",
            f"{row['worst_condition']:.2g}",
            str(row["seed_used"]),
            f"{row['single_seed_spread']:.0f}x",
            "yes" if row["admitted"] else "**no**",
        ]
        assert "| " + " | ".join(cells) + " |" in text, cells


def _block(text: str, begin: str, end: str) -> str:
    return text[text.index(begin) : text.index(end) + len(end)]


def test_bounded_staleness_blocks_are_what_the_benchmark_renders_from_their_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bounded_staleness as bs

    text = (RESULTS / "bounded_staleness.md").read_text()
    for name, results in (("bounded", "bounded_staleness.json"), ("bounded-choice", "bounded_choice.json")):
        assert _block(text, *bs.MARKS[name]) == bs.render_markdown(json.loads((RESULTS / results).read_text())), name


def test_emulated_map_blocks_are_what_the_renderer_makes_from_their_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import emulated_render as er

    from pgc_lab.map.rounds import is_complete, shipped_summary

    shipped = shipped_summary()  # the full round once it is complete, else the reduced one
    source = shipped.relative_to(ROOT).as_posix()
    summary = json.loads(shipped.read_text())
    assert is_complete(summary), source
    grid = json.loads((RESULTS / "grid_map.json").read_text())
    assert _block((RESULTS / "benchmarks.md").read_text(), er.BEGIN, er.END) == er.render(summary, source, grid)
    cost = _block((RESULTS / "emulator.md").read_text(), er.COST_BEGIN, er.COST_END)
    assert cost == er.render_cost(summary["cost"], source)


def test_simulation_blocks_are_what_the_simulator_scripts_render_from_their_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sim_grid
    import sim_validate

    text = (RESULTS / "simulation.md").read_text()
    validation = json.loads((RESULTS / "sim_validation.json").read_text())
    assert _block(text, sim_validate.MARK_BEGIN, sim_validate.MARK_END) == sim_validate.render(validation)
    grid = json.loads((RESULTS / "sim_grid.json").read_text())
    assert _block(text, sim_grid.MARK_BEGIN, sim_grid.MARK_END) == sim_grid.render(grid, grid["command"])


def test_advise_and_end_to_end_blocks_are_what_their_scripts_render_from_their_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import advise_trace
    import validate_e2e

    out = json.loads((RESULTS / "advise_slow_rank.json").read_text())
    trace = json.loads((RESULTS / "advise_trace.json").read_text())
    guide = (DOCS / "guide.md").read_text()
    assert _block(guide, advise_trace.MARK_BEGIN, advise_trace.MARK_END) == advise_trace.guide_block(out, trace)
    e2e = json.loads((RESULTS / "validation_e2e.json").read_text())
    page = (RESULTS / "emulator.md").read_text()
    assert _block(page, validate_e2e.MARK_BEGIN, validate_e2e.MARK_END) == validate_e2e.render(e2e)


@pytest.mark.parametrize("name", ["step_time", "stall"])
def test_measured_pages_are_what_their_benchmark_renders_from_their_json(name: str) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    module = __import__(name)
    assert (
        module.render_markdown(json.loads((RESULTS / f"{name}.json").read_text()))
        == (RESULTS / f"{name}.md").read_text()
    )


def test_the_data_plane_page_is_what_the_benchmark_renders_from_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_time

    page = step_time.render_planes_markdown(json.loads((RESULTS / "step_time_planes.json").read_text()))
    assert page == (RESULTS / "step_time_planes.md").read_text()


def test_the_added_passes_page_is_what_its_benchmark_renders_and_reads_the_plane_it_cites() -> None:
    """The pass timings sit beside the gap measured on the data plane: the gap they quote is that file's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_passes

    passes = json.loads((RESULTS / "step_time_passes.json").read_text())
    assert step_passes.render(passes) == (RESULTS / "step_time_passes.md").read_text()
    planes = json.loads((RESULTS / "step_time_planes.json").read_text())["seconds_per_step"]
    for model, (pgc, ddp) in step_passes.PAIRS.items():
        gap = [(a - b) * 1e3 for a, b in zip(planes[pgc], planes[ddp])]
        assert passes["models"][model]["measured_gap_ms"] == pytest.approx(gap)


def test_the_gpu_check_page_is_what_its_benchmark_renders_from_its_json() -> None:
    """Every number of docs/results/gpu_check.md (measured on one GPU) is rendered from docs/results/gpu_check.json."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    result = json.loads((RESULTS / "gpu_check.json").read_text())
    assert gpu_check.render(result) == (RESULTS / "gpu_check.md").read_text()
    assert gpu_check.merge([result]) == result  # (a merged file merges to itself)


def test_the_rejoin_page_is_what_its_benchmark_renders_from_its_results_file() -> None:
    """docs/results/rejoin.md (state transfer from 1 M to 100 M parameters) is rendered from docs/results/rejoin.json."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import rejoin

    result = json.loads((RESULTS / "rejoin.json").read_text())
    assert rejoin.render(result) == (RESULTS / "rejoin.md").read_text()


def test_the_auto_page_is_what_its_benchmark_renders_from_its_results_file() -> None:
    """docs/results/auto.md (pgc_auto against ddp and the fixed arms) is rendered from docs/results/auto.json."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import auto

    result = json.loads((RESULTS / "auto.json").read_text())
    assert auto.render(result) == (RESULTS / "auto.md").read_text()


def test_the_memory_page_is_what_its_benchmark_renders_from_its_results_file() -> None:
    """docs/results/memory.md (every rank's peak RSS under ddp and each scheme) is rendered from docs/results/memory.json."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory

    result = json.loads((RESULTS / "memory.json").read_text())
    assert memory.render(result) == (RESULTS / "memory.md").read_text()
    assert memory.add_goals([dict(r) for r in result["runs"]]) == result["runs"]  # (the goals follow from the runs)


@pytest.mark.parametrize("report", ["staleness", "staleness_bounded", "staleness_exponential", "staleness_stalls"])
def test_staleness_pages_are_what_the_benchmark_renders_from_their_json(report: str) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import staleness

    saved = json.loads((RESULTS / f"{report}.json").read_text())
    assert staleness.render(saved) == (RESULTS / f"{report}.md").read_text()


def test_the_safety_valve_page_is_what_its_benchmark_renders_from_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import safety_valve

    saved = json.loads((RESULTS / "safety_valve.json").read_text())
    assert safety_valve.render(saved) == (RESULTS / "safety_valve.md").read_text()


def test_the_hard_tasks_page_is_what_its_script_renders_from_the_hard_rounds_summary() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hard_render

    source = RESULTS / "emulated_map_hard.json"
    text = (RESULTS / "hard_tasks.md").read_text()
    block = text[text.index(hard_render.BEGIN) : text.index(hard_render.END) + len(hard_render.END)]
    assert block == hard_render.render(json.loads(source.read_text()), str(source))
    guide = (DOCS / "guide.md").read_text()
    block = guide[
        guide.index(hard_render.GUIDE_BEGIN) : guide.index(hard_render.GUIDE_END) + len(hard_render.GUIDE_END)
    ]
    assert block == hard_render.guide_block(json.loads(source.read_text()))


def test_a_hard_cell_where_ddp_missed_on_every_seed_gets_no_verdict_and_never_keep_ddp() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hard_render

    summary = json.loads((RESULTS / "emulated_map_hard.json").read_text())
    missed = [c for c in summary["cells"] if c["ddp_missed"]]
    assert missed, "the shipped hard round has a cell where ddp missed on every seed"
    rows = {line for line in hard_render.guide_block(summary).splitlines() if line.startswith("| ")}
    for c in missed:
        row = next(
            r for r in rows if r.startswith(f"| {c['cell']['task']} | {c['cell']['n']} | {c['cell']['pattern']} |")
        )
        assert "no verdict" in row and "keep `ddp`" not in row
        fastest = min(
            (a for a in c["arms"] if a["arm"] != "ddp" and a["reached_late"] == a["seeds"]),
            key=lambda a: a["rmean_late_s"],
        )
        assert f"the fastest {fastest['arm']} at most {fastest['vs_ddp_late']['ratio']:.2f}x" in row
        assert "nothing is ranked" in "\n".join(hard_render.cell_lines(c))
    kept = [c for c in summary["cells"] if not c["ddp_missed"] and c.get("winner") is None]
    assert kept and all(
        "keep `ddp`" in next(r for r in rows if f"| {c['cell']['pattern']} |" in r and f"| {c['cell']['task']} |" in r)
        for c in kept
    )


def test_the_reduced_rounds_timing_paragraph_is_what_its_script_renders_from_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import reduced_timing

    results = json.loads(reduced_timing.RESULTS.read_text())
    text = (RESULTS / "emulator.md").read_text()
    block = text[text.index(reduced_timing.BEGIN) : text.index(reduced_timing.END) + len(reduced_timing.END)]
    assert block == reduced_timing.block(results)
    assert (
        results["wall_s"] < 30 * 60 and results["items"] == json.loads(reduced_timing.SHIPPED.read_text())["items_done"]
    )
