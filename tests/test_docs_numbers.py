"""Every number in the tables of README.md and docs/*.md comes from the results field or the code it cites.

A table written by hand cites its numbers in an HTML comment above it, in its section (heading to heading):

    <!-- numbers: docs/step_time.json#seconds_per_step docs/step_time.json#ratios.*.median -->

Each citation is a file and a key path into it (``.``-separated keys or list indices, ``*`` for any one),
optionally bound to one column of the table (``3=docs/x.json#runs.*.val_acc``: the table's third cell). A number
must be one of the numbers under the citations bound to its column, or, for a column with none bound, under the
unbound ones, at the precision shown: no rescaling (seconds are not
found as milliseconds), and no match as a substring. For a ``.py`` file the key is a top-level function, class or
constant name, and the numbers are its numeric literals (``tests/test_theory.py#test_lemma3_...``); for a recipe
``.yaml`` the key path reads its values. Integers below 10 are not checked (ranks, ``s``, ``c``, counts of rows:
structure rather than results); neither are numbers that are part of a name (``bf16-mixed``).

Tables that a script generates (between its begin/end markers, or a whole generated page) are not cited by hand:
they are regenerated from their results file and compared exactly (:data:`GENERATED`, and the tests at the end of
this file, tests/test_grid_map.py and tests/test_readme.py).
"""

from __future__ import annotations

import ast
import csv
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
NUMBER = re.compile(r"(?<![\w.-])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.]|-[a-z])", re.I)
CITATION = re.compile(r"<!-- numbers: (.+?) -->")
SEPARATOR = re.compile(r"^\s*\|[-:| ]+\|\s*$")

#: Tables checked by exact regeneration instead: page -> the marker names of its generated blocks ("*": the page)
GENERATED: dict[str, set[str]] = {
    "README.md": {"which"},  # tests/test_readme.py
    "docs/benchmarks.md": {"gridmap", "grid", "emulated"},  # tests/test_grid_map.py; below
    "docs/emulator.md": {"emulated-cost"},  # below
    "docs/bounded_staleness.md": {"bounded", "bounded-choice"},  # below
    "docs/simulation.md": {"sim", "simgrid"},  # below
    "docs/demo.md": {"*"},  # below
    "docs/demo_correction.md": {"*"},  # below
    "docs/staleness_emulated.md": {"*"},  # below
    "docs/step_time.md": {"*"},  # below
    "docs/step_time_planes.md": {"*"},  # below
    "docs/step_time_passes.md": {"*"},  # below
    "docs/gpu_check.md": {"*"},  # below
    "docs/stall.md": {"*"},  # below
    "docs/math.md": {"table:| n | s | C(n,s) |"},  # its rows, below
}


def tables(text: str) -> list[tuple[int, list[str], str]]:
    """(first line, table rows without the separator, the citations that apply) for every table: the last
    ``numbers`` comment above it in its section."""
    lines = text.splitlines()
    headings = [i for i, line in enumerate(lines) if line.startswith("#")] + [len(lines)]
    out = []
    i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("|"):
            i += 1
            continue
        j = i
        while j < len(lines) and lines[j].lstrip().startswith("|"):
            j += 1
        start = max([h for h in headings if h <= i], default=0)
        cited = [m.group(1) for line in lines[start:i] for m in CITATION.finditer(line)]
        rows = [line for line in lines[i:j] if not SEPARATOR.match(line)]
        out.append((i + 1, rows, cited[-1] if cited else ""))
        i = j
    return out


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


def checked_cells(rows: list[str]) -> list[tuple[int, str]]:
    """(1-based column, number) of the body rows' numbers that must be backed by a source."""
    found = []
    for row in rows[1:]:
        cells = row.strip().strip("|").split(" | ")
        for column, cell in enumerate(cells, 1):
            for token in NUMBER.findall(cell.replace("`", " ")):
                if "." in token or "e" in token.lower() or abs(float(token)) >= 10:
                    found.append((column, token))
    return found


def checked_numbers(rows: list[str]) -> list[str]:
    """The numbers of the body rows that must be backed by a source."""
    return [token for _, token in checked_cells(rows)]


def values_by_column(cited: str) -> dict[int, list[float]]:
    """Column (0: every column without its own citation) -> the numbers cited for it."""
    out: dict[int, list[float]] = {}
    for citation in cited.split():
        column, _, rest = citation.partition("=") if re.match(r"\d+=", citation) else ("0", "", citation)
        out.setdefault(int(column), []).extend(cited_numbers(rest))
    return out


def unbacked(rows: list[str], cited: str) -> list[str]:
    """The numbers of a table not under the citations that apply to their column."""
    values = values_by_column(cited)
    return [token for column, token in checked_cells(rows) if not backed(token, values.get(column, values.get(0, [])))]


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
        out.extend(float(t) for t in NUMBER.findall(x))


def _select(x: Any, keys: list[str]) -> list[Any]:
    if not keys:
        return [x]
    key, rest = keys[0], keys[1:]
    if isinstance(x, dict):
        children = list(x.values()) if key == "*" else [x[key]] if key in x else []
    elif isinstance(x, list):
        children = (
            x if key == "*" else [x[int(key)]] if key.lstrip("-").isdigit() and -len(x) <= int(key) < len(x) else []
        )
    else:
        children = []
    return [found for child in children for found in _select(child, rest)]


def _resolve(name: str) -> Path:
    for candidate in (ROOT / name, DOCS / name, ROOT / "recipes" / name):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(name)


def cited_numbers(citation: str) -> list[float]:
    """The numbers one citation (``file#key.path``) names; raises if the file or the key does not exist."""
    name, _, key = citation.partition("#")
    if not key:
        raise ValueError(f"{citation}: cite a key (file#key), not a whole file")
    path = _resolve(name)
    values: list[float] = []
    if path.suffix == ".py":
        tree = ast.parse(path.read_text())
        nodes = [
            n
            for n in tree.body
            if (isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == key)
            or (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == key for t in n.targets))
        ]
        if not nodes:
            raise KeyError(f"{citation}: no top-level {key} in {name}")
        for node in nodes:
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Constant)
                    and isinstance(sub.value, (int, float))
                    and not isinstance(sub.value, bool)
                ):
                    values.append(float(sub.value))
                elif (
                    isinstance(sub, ast.UnaryOp)
                    and isinstance(sub.op, ast.USub)
                    and isinstance(sub.operand, ast.Constant)
                    and isinstance(sub.operand.value, (int, float))
                ):
                    values.append(-float(sub.operand.value))
        return values
    if path.suffix == ".yaml":
        import yaml

        data = yaml.safe_load(path.read_text())
    elif path.suffix == ".csv":
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        data = [row[key] for row in rows if key in row]
        if not data:
            raise KeyError(f"{citation}: no column {key} in {name}")
        _numbers(data, values)
        return values
    else:
        data = json.loads(path.read_text())
    found = _select(data, key.split("."))
    if not found:
        raise KeyError(f"{citation}: no key {key} in {name}")
    _numbers(found, values)
    return values


def matches(token: str, value: float) -> bool:
    """``value`` shown at the precision of ``token`` is ``token``."""
    shown = float(token)
    if "e" in token.lower():
        mantissa = token.lower().split("e")[0]
        digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return (
            shown != 0
            and abs(value - shown) <= 0.5 * 10 ** (-digits) * 10 ** math.floor(math.log10(abs(shown))) * 1.0001
        )
    decimals = len(token.split(".")[1]) if "." in token else 0
    return abs(value - shown) <= 0.5 * 10 ** (-decimals) * 1.0001


def backed(token: str, values: list[float]) -> bool:
    return any(matches(token, v) for v in values)


def hand_tables() -> list[tuple[str, int, list[str], str]]:
    """(page, first line, rows, citations) of every table written by hand that has checked numbers."""
    out = []
    for page in PAGES:
        where = str(page.relative_to(ROOT))
        text = page.read_text()
        skip = generated_lines(text, GENERATED.get(where, set()))
        for line, rows, cited in tables(text):
            if line not in skip and checked_numbers(rows):
                out.append((where, line, rows, cited))
    return out


@pytest.mark.parametrize("where, line, rows, cited", [pytest.param(*t, id=f"{t[0]}:{t[1]}") for t in hand_tables()])
def test_every_table_number_is_under_the_key_it_cites(where: str, line: int, rows: list[str], cited: str) -> None:
    numbers = checked_numbers(rows)
    assert cited, f"{where}:{line}: a table with numbers {numbers[:5]} has no <!-- numbers: file#key ... --> above it"
    missing = unbacked(rows, cited)
    assert not missing, f"{where}:{line}: not under {cited}: {missing}"


def test_the_checker_catches_a_wrong_number(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "r.json").write_text(json.dumps({"a": 0.98667, "b": [12.34, 2.0e-5], "c": {"ms": 1234.0}}))
    a = cited_numbers("r.json#a")
    assert backed("0.987", a) and not backed("0.988", a) and not backed("12.3", a)  # only the cited key
    b = cited_numbers("r.json#b")
    assert backed("12.3", b) and backed("2e-05", b) and not backed("12.4", b) and not backed("3e-05", b)
    assert not backed("1.234", cited_numbers("r.json#c.ms")) and not backed("12340", b)  # no rescaling
    assert cited_numbers("r.json#b.1") == [2.0e-5] and cited_numbers("r.json#*") == [0.98667, 12.34, 2.0e-5, 1234.0]
    with pytest.raises(KeyError):
        cited_numbers("r.json#d")
    with pytest.raises(ValueError, match="cite a key"):
        cited_numbers("r.json")
    (tmp_path / "t.py").write_text(
        "LIMIT = 0.25\n\n\ndef f():\n    assert g() < 1.5  # 7.75 in a comment\n    return 'v2.125', -3.5\n"
    )
    f = cited_numbers("t.py#f")
    assert backed("1.5", f) and backed("-3.5", f) and not backed("0.25", f)  # LIMIT is not in f
    assert not backed("7.75", f) and not backed("2.125", f) and not backed("1.6", f)  # no comment, no substring
    assert backed("0.25", cited_numbers("t.py#LIMIT"))
    page = (
        "# t\n\n<!-- numbers: r.json#a 3=r.json#b -->\n\n| x | y | z |\n|---|---|---|\n| a | 0.988 | 12.3 |\n"
        "| b | 16-mixed | 0.987 |\n"
    )
    ((line, rows, cited),) = tables(page)
    assert checked_cells(rows) == [(2, "0.988"), (3, "12.3"), (3, "0.987")] and cited == "r.json#a 3=r.json#b"
    assert unbacked(rows, cited) == ["0.988", "0.987"]  # 0.987 is under #a, but column 3 cites #b


def _last_digit_changed(token: str, delta: int) -> str:
    """``token`` with its last digit moved by ``delta`` (carrying), or "" when that changes its length."""
    mantissa, _, exponent = token.lower().partition("e")
    sign = mantissa[: len(mantissa) - len(mantissa.lstrip("+-"))]
    digits = mantissa[len(sign) :]
    body = digits.replace(".", "")
    if int(body) + delta < 0 or len(str(int(body) + delta).rjust(len(body), "0")) != len(body):
        return ""
    changed = str(int(body) + delta).rjust(len(body), "0")
    point = digits.find(".")
    if point >= 0:
        changed = changed[:point] + "." + changed[point:]
    return sign + changed + (f"e{exponent}" if exponent else "")


def test_a_number_changed_in_its_last_digit_fails():
    """Every checked number of every hand-written table, with its last digit one up and one down, is checked
    against the keys its table cites. A change passes only where the changed value is itself under a cited key
    (a column of nearby values); the share of such coincidences is bounded, so a wrong number is caught."""
    assert _last_digit_changed("0.987", 1) == "0.988" and _last_digit_changed("12", -1) == "11"
    assert _last_digit_changed("2e-05", 1) == "3e-05" and _last_digit_changed("1.0", -1) == "0.9"
    assert _last_digit_changed("-0.25", 1) == "-0.26" and _last_digit_changed("9", 1) == ""
    tried, passed = 0, []
    for where, line, rows, cited in hand_tables():
        values = values_by_column(cited)
        for column, token in checked_cells(rows):
            for delta in (1, -1):
                changed = _last_digit_changed(token, delta)
                if changed:
                    tried += 1
                    if backed(changed, values.get(column, values.get(0, []))):
                        passed.append(f"{where}:{line}: {token} -> {changed}")
    assert tried >= 200
    assert len(passed) / tried < 0.1, f"{len(passed)} of {tried} changed numbers still pass: {passed[:20]}"


def test_benchmarks_block_is_what_grid_renders_from_benchmarks_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import grid

    result = json.loads((DOCS / "benchmarks.json").read_text())
    text = (DOCS / "benchmarks.md").read_text()
    block = text[text.index(grid.MARK_BEGIN) : text.index(grid.MARK_END) + len(grid.MARK_END)]
    assert block == grid.render_markdown(result, result["table"])


def test_demo_page_is_what_the_demo_renders_from_demo_json() -> None:
    from lightning_pgc import demo

    saved = json.loads((DOCS / "demo.json").read_text())
    args = demo.parse_args([])
    args.__dict__.update(saved["settings"])
    outcomes = demo.read_outcomes(saved["results"])
    assert demo.page(outcomes, args, saved["command"]) == (DOCS / "demo.md").read_text()


def test_demo_correction_page_is_what_the_demo_renders_from_its_json() -> None:
    from lightning_pgc import demo_correction as dc

    saved = json.loads((DOCS / "demo_correction.json").read_text())
    page = dc.page(dc.read_saved(saved["results"]), dc.measured(), saved["command"])
    assert page == (DOCS / "demo_correction.md").read_text()


def test_staleness_emulated_page_is_what_its_script_renders_from_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import staleness_emulated as se

    summary = json.loads((DOCS / "staleness_emulated.json").read_text())
    assert se.render(summary) == (DOCS / "staleness_emulated.md").read_text()
    assert se.summarize(se.read_records(se.RECORDS)) == summary  # the summary is the records'


def test_math_conditioning_table_is_tandon_conditions_json() -> None:
    saved = json.loads((DOCS / "tandon_conditions.json").read_text())
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

    text = (DOCS / "bounded_staleness.md").read_text()
    for name, results in (("bounded", "bounded_staleness.json"), ("bounded-choice", "bounded_choice.json")):
        assert _block(text, *bs.MARKS[name]) == bs.render_markdown(json.loads((DOCS / results).read_text())), name


def test_emulated_map_blocks_are_what_the_renderer_makes_from_their_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import emulated_render as er

    from lightning_pgc.emulator.rounds import is_complete, shipped_summary

    shipped = shipped_summary()  # the full round once it is complete, else the reduced one
    source = shipped.relative_to(ROOT).as_posix()
    summary = json.loads(shipped.read_text())
    assert is_complete(summary), source
    grid = json.loads((DOCS / "grid_map.json").read_text())
    assert _block((DOCS / "benchmarks.md").read_text(), er.BEGIN, er.END) == er.render(summary, source, grid)
    cost = _block((DOCS / "emulator.md").read_text(), er.COST_BEGIN, er.COST_END)
    assert cost == er.render_cost(summary["cost"], source)


def test_simulation_blocks_are_what_the_simulator_scripts_render_from_their_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sim_grid
    import sim_validate

    text = (DOCS / "simulation.md").read_text()
    validation = json.loads((DOCS / "sim_validation.json").read_text())
    assert _block(text, sim_validate.MARK_BEGIN, sim_validate.MARK_END) == sim_validate.render(validation)
    grid = json.loads((DOCS / "sim_grid.json").read_text())
    assert _block(text, sim_grid.MARK_BEGIN, sim_grid.MARK_END) == sim_grid.render(grid, grid["command"])


@pytest.mark.parametrize("name", ["step_time", "stall"])
def test_measured_pages_are_what_their_benchmark_renders_from_their_json(name: str) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    module = __import__(name)
    assert module.render_markdown(json.loads((DOCS / f"{name}.json").read_text())) == (DOCS / f"{name}.md").read_text()


def test_the_data_plane_page_is_what_the_benchmark_renders_from_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_time

    page = step_time.render_planes_markdown(json.loads((DOCS / "step_time_planes.json").read_text()))
    assert page == (DOCS / "step_time_planes.md").read_text()


def test_the_added_passes_page_is_what_its_benchmark_renders_and_reads_the_plane_it_cites() -> None:
    """The pass timings sit beside the gap measured on the data plane: the gap they quote is that file's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_passes

    passes = json.loads((DOCS / "step_time_passes.json").read_text())
    assert step_passes.render(passes) == (DOCS / "step_time_passes.md").read_text()
    planes = json.loads((DOCS / "step_time_planes.json").read_text())["seconds_per_step"]
    for model, (pgc, ddp) in step_passes.PAIRS.items():
        gap = [(a - b) * 1e3 for a, b in zip(planes[pgc], planes[ddp])]
        assert passes["models"][model]["measured_gap_ms"] == pytest.approx(gap)


def test_the_gpu_check_page_is_what_its_benchmark_renders_from_its_json() -> None:
    """Every number of docs/gpu_check.md (measured on one GPU) is rendered from docs/gpu_check.json."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    result = json.loads((DOCS / "gpu_check.json").read_text())
    assert gpu_check.render(result) == (DOCS / "gpu_check.md").read_text()
    assert gpu_check.merge([result]) == result  # (a merged file merges to itself)


@pytest.mark.parametrize("report", ["staleness", "staleness_bounded"])
def test_staleness_pages_are_what_the_benchmark_renders_from_their_json(report: str) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import staleness

    saved = json.loads((DOCS / f"{report}.json").read_text())
    assert staleness.render(saved) == (DOCS / f"{report}.md").read_text()
