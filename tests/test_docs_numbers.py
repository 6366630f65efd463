"""Every number of README.md and docs/ comes from a results file, recipe or code: docs/results/numbers.csv says
where each one stands and what it is read from (``pgc_lab.numbers``: what a row is, what a source is, which numbers
are read). Rebuild a page's rows after editing it: ``python benchmarks/docs_numbers.py PAGE``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pgc_lab.numbers import ROOT, TABLE, Found, Page, Row, check, numbers_in, pages, place, read_page
from pgc_lab.numbers import read_table, shows
from pgc_lab.numbers import source_values as values

ROWS = read_table()


@pytest.mark.parametrize("where", pages())
def test_every_number_of_the_page_has_a_row_and_every_row_stands_with_its_source(where: str) -> None:
    wrong = check(where, read_page(where, (ROOT / where).read_text()), ROWS)
    assert not wrong, f"{len(wrong)} problems (python benchmarks/docs_numbers.py {where}):\n" + "\n".join(wrong)


def test_the_table_names_only_pages_that_exist() -> None:
    assert TABLE.read_text().splitlines()[0] == ",".join(Row._fields)
    assert {row.page for row in ROWS} <= set(pages())


def test_a_source_names_its_numbers_at_the_precision_shown(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text(json.dumps({"a": 0.98667, "b": [12.34, 2e-5], "c": {"ms": 1234.0}}))
    r = f"{tmp_path}/r.json"
    assert shows("0.987", values(f"{r}#a")) and not shows("0.988", values(f"{r}#a"))
    assert shows("2e-05", values(f"{r}#b")) and not shows("12.3", values(f"{r}#a")) and values(f"{r}#b.1") == [2e-5]
    assert not shows("1.234", values(f"{r}#c.ms")) and shows("1.2k", values(f"{r}#c.ms"))  # no implicit rescaling
    assert shows("20.6", values(f"{r}#c.ms@min")) and shows("98.7", values(f"{r}#a@%"))
    assert (
        values(f"{r}#*@count") == [3] and values(f"{r}#b@most") == [12.34] and shows("20.8", values(f"{r}#*@sum@min"))
    )
    with pytest.raises(KeyError):
        values(f"{r}#d")
    (tmp_path / "runs.json").write_text(json.dumps({"cells": {"slow-a": {"arms": [{"arm": "gc", "x": 0.5}]}}}))
    assert values(f"{tmp_path}/runs.json#cells.slow-*.arms.gc.x") == [0.5]  # a glob, a record by its name
    (tmp_path / "t.py").write_text(
        "'Run it with --scale 0.001.'\nSTEPS, TARGET = 120, 0.3\n\n\ndef f():\n    '1.25 in a docstring'\n"
        "    assert g() < 1.5  # 7.75 in a comment\n    raise ValueError(f'lost {d} of 16 digits', -3.5)\n\n\n"
        "class K:\n    def m(self, x=12.5, *, y=0.75):\n        return 2.75\n\n\n"
        "p.add_argument('--steps', type=int, default=200)\nTABLE = {'a': 1.25, 'b': Cost('c', 2.5)}\n"
    )
    t = f"{tmp_path}/t.py"
    assert sorted(values(f"{t}#f")) == [-3.5, 1.5, 3.5, 16] and values(f"{t}#__doc__") == [0.001]
    assert values(f"{t}#TARGET") == [0.3] and values(f"{t}#K.m.y") == [0.75] and values(f"{t}#--steps") == [200]
    assert values(f"{t}#TABLE.a") == [1.25] and values(f"{t}#TABLE.c") == [2.5] and len(values(f"{t}#K.m")) == 3


def test_the_numbers_read_are_results_not_names_dates_or_structure() -> None:
    line = "`--lr 0.05`, 0.79x-0.81x, 38k, 1.7M, -3.5, 5 %, 12. 1x1 ResNet-18 bf16-mixed 2026-12-02 arXiv 2607.20739"
    assert [t for _, t in numbers_in(line)] == ["0.05", "0.79x", "0.81x", "38k", "1.7M", "-3.5", "12"]
    page = "# t 12\n<!-- 13 -->\n| a 14 |\n|---|\n| 15 |\n\n## A complete example\n```\n16\n```\n"
    assert [(f.section, f.token) for f in read_page("README.md", page).found] == [("t 12", "12"), ("t 12", "15")]


def _last_digit_changed(token: str, delta: int) -> str:
    """``token`` with its last digit moved by ``delta`` (carrying), or "" where that changes its length."""
    sign, mantissa, tail = re.fullmatch(r"([-+]?)([\d.]+)(.*)", token).groups()  # type: ignore[union-attr]
    digits = mantissa.replace(".", "")
    moved = str(int(digits) + delta).zfill(len(digits))
    point = mantissa.find(".")
    moved = moved if point < 0 else moved[:point] + "." + moved[point:]
    lost = int(digits) + delta < 0 or len(moved) != len(mantissa) or re.match(r"0\d", moved)  # not 10 -> 09
    return "" if lost else sign + moved + tail


def test_every_number_changed_in_its_last_digit_is_flagged() -> None:
    """Each number of each page, one up and one down in its last digit (where that keeps its length), in memory:
    the check fails. README's changes are checked on the whole changed page; elsewhere, as a row stands on one line
    found once in its section, the changed line is checked with the rows that stood on it."""
    assert _last_digit_changed("0.987", 1) == "0.988" and _last_digit_changed("12", -1) == "11"
    assert _last_digit_changed("2e-05", 1) == "3e-05" and _last_digit_changed("1.0", -1) == "0.9"
    assert _last_digit_changed("0.79x", 1) == "0.80x" and _last_digit_changed("10", -1) == ""
    assert _last_digit_changed("-0.25", 1) == "-0.26" and _last_digit_changed("9", 1) == ""
    guarded, tried, missed = 0, 0, []
    for where in pages():
        page = read_page(where, (ROOT / where).read_text())
        placed, _ = place(page, [row for row in ROWS if row.page == where])
        for f in page.found:
            guarded += 1
            line = page.lines[f.line - 1]
            for changed in filter(None, (_last_digit_changed(f.token, d) for d in (1, -1))):
                tried += 1
                lines = page.lines.copy()
                lines[f.line - 1] = edited = line[: f.start] + changed + line[f.start + len(f.token) :]
                if where == "README.md":
                    flagged = check(where, read_page(where, "\n".join(lines)), ROWS)
                else:
                    again = [Found(f.section, f.line, i, token) for i, token in numbers_in(edited)]
                    rows = [row for g, row in placed.items() if g.line == f.line]
                    flagged = check(where, Page(lines, {f.section: [f.line]}, again), rows)
                missed += [] if flagged else [f"{where}:{f.line}: {f.token} -> {changed}"]
    assert guarded >= 2400 and tried >= 2 * guarded - 300, (guarded, tried)
    assert not missed, f"{len(missed)} of {tried} changed numbers pass:\n" + "\n".join(missed[:50])
