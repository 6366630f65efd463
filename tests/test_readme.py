"""README.md can be acted on: its example runs as pasted, its "Which strategy should I use" table (and the guide's map
section) is what benchmarks/which_strategy.py renders from docs/results/which_strategy.json (and that file follows the map it
names), and the error messages docs/troubleshooting.md quotes are the ones the code raises."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import which_strategy  # noqa: E402

README = (ROOT / "README.md").read_text()


def example() -> str:
    section = README[README.index("## A complete example") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_example_runs_as_pasted(tmp_path):
    """The example, saved as a file and run with python (Lightning's launcher re-runs it for the second rank),
    trains to the end and prints a rank table for both ranks."""
    script = tmp_path / "example.py"
    script.write_text(example())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=30` reached." in done.stderr + done.stdout
    table = [line for line in done.stdout.splitlines() if line.startswith("[{")]
    assert len(table) == 1 and table[0].count("'rank':") == 2, done.stdout[-2000:]  # rank 0 prints it


def test_the_readme_fits_150_lines_and_says_its_limits_before_anything_else():
    """A reader gets the limits first, then the decision rule, in a page they read to the end."""
    assert len(README.splitlines()) <= 150
    sections = [line for line in README.splitlines() if line.startswith("## ")]
    assert sections[:2] == ["## What to know first", "## Which strategy: the rule"]
    assert "NCCL with one GPU per rank has not run" in README and "torchrun" in README and "Re-tune `lr`" in README


def test_the_readme_keeps_the_fresh_machine_commands():
    assert "make demo   #" in README and "make test   #" in README


def _heading_slugs(path: str) -> set[str]:
    return {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in (ROOT / path).read_text().splitlines()
        if line.startswith("#")
    }


def test_the_which_strategy_table_and_the_guides_section_are_rendered_from_its_file():
    """README's block and docs/guide.md's are what the renderer makes of docs/results/which_strategy.json; every row states
    the task, n, pattern, arm, ratio with interval and how sure, and its evidence link lands on a heading; where no
    pipelined scheme wins a cell, both pages say so in plain words."""
    table = json.loads((ROOT / "docs" / "results" / "which_strategy.json").read_text())
    from lightning_pgc.strategy import REGISTERED

    which_strategy.check(table, set(REGISTERED))
    begin, end = README.index(which_strategy.MARK_BEGIN), README.index(which_strategy.MARK_END)
    assert README[begin : end + len(which_strategy.MARK_END)] == which_strategy.render(table)
    guide = (ROOT / "docs" / "guide.md").read_text()
    begin, end = guide.index(which_strategy.GUIDE_BEGIN), guide.index(which_strategy.GUIDE_END)
    assert guide[begin : end + len(which_strategy.GUIDE_END)] == which_strategy.render_guide(table)
    block = which_strategy.render_guide(table)
    assert block.count("\n| ") == len(table["rows"]) + 1  # the header and one line per row
    for row in table["rows"]:
        assert row["task"] and row["n"] >= 2 and row["pattern"] and row["sure"]
        if row["strategy"] != "ddp":
            assert row["low"] <= row["ratio"] <= row["high"] < 1 and row["p_holm"] < table["alpha"]
        path, anchor = row["evidence"].split("#")
        assert anchor in _heading_slugs(path), row["evidence"]
    said = which_strategy.NO_PGC in which_strategy.render(table)
    assert said == (table["pipelined_wins"] == 0)
    assert said == (which_strategy.NO_PGC.replace("(docs/", "(") in guide)


def test_the_registered_pgc_is_the_pipelined_configuration_the_map_recommends():
    """``strategy="pgc"`` runs the pipelined arm the map names most often (scheme, s and staleness correction, at the
    correction's default ``k``), so the default and the guide's evidence cannot drift apart; the uncorrected scheme
    stays available as ``pgc_cr``."""
    from collections import Counter

    from lightning_pgc.strategy import REGISTERED

    table = json.loads((ROOT / "docs" / "results" / "which_strategy.json").read_text())
    corrections = ("lookahead", "delay_compensation", "momentum")
    named = Counter(
        (r["strategy"], r["s"], next((w for w in r["arm"].split() if w in corrections), None))
        for r in table["rows"]
        if r["strategy"] in which_strategy.PIPELINED
    )
    assert named, "the map names no pipelined arm: decide what strategy='pgc' runs, and say so in README"
    (scheme, s, correction), _ = named.most_common(1)[0]
    coding = {"coding": {"staleness_correction": correction}} if correction else {}
    assert REGISTERED["pgc"].kwargs == {"scheme": scheme, "stragglers": s, **coding}
    assert REGISTERED["pgc_cr"].kwargs == {"scheme": "pgc_cr", "stragglers": 1}
    assert f"`pgc` | `{scheme}` with the look-ahead staleness correction" in README or correction != "lookahead"


def test_the_no_pipelined_win_statement_cites_the_theory_it_rests_on():
    for page, anchor in (("docs/results/theory.md", "1-what-the-paper-claims"), ("docs/math.md", "the-schemes")):
        assert f"({page}#{anchor})" in which_strategy.NO_PGC
        assert anchor in _heading_slugs(page)


def test_the_which_strategy_file_follows_the_map_it_was_derived_from():
    """The file is exactly what the rule derives from the emulated map summary it names (the round the docs show)."""
    from pgc_lab.map.rounds import shipped_summary

    table = json.loads((ROOT / "docs" / "results" / "which_strategy.json").read_text())
    assert table["source"] == shipped_summary().relative_to(ROOT).as_posix()
    source = json.loads((ROOT / table["source"]).read_text())
    assert table == which_strategy.build(source, table["source"])


def test_a_round_that_is_not_finished_is_neither_rendered_nor_turned_into_the_guide(tmp_path):
    import emulated_render

    from pgc_lab.map.rounds import is_complete, shipped_summary

    summary = json.loads(shipped_summary().read_text())
    assert is_complete(summary)
    partial = dict(summary, items_planned=summary["items_done"] + 1, round="full")
    path = tmp_path / "emulated_map_full.json"
    path.write_text(json.dumps(partial))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("untouched\n")
    with pytest.raises(SystemExit, match="resume it"):
        emulated_render.main(["--summary", str(path), "--doc", str(doc)])
    with pytest.raises(SystemExit, match="resume it"):
        which_strategy.main(["--summary", str(path)])
    assert doc.read_text() == "untouched\n"


def test_every_error_troubleshooting_quotes_is_raised_by_the_code():
    """Each quoted message's longest fixed stretch (between placeholders and quotes) is in the package's source,
    or in Lightning's for its own strategy-name error."""
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    quoted = re.findall(r"^\*\*`(?:\w+: )?(.+?)`\*\*$", page, re.M) + re.findall(r"^\| `(.+?)` \|", page, re.M)
    source = "\n".join(p.read_text() for p in (ROOT / "lightning_pgc").rglob("*.py"))
    import lightning

    lightning = Path(lightning.__file__)
    source += (lightning.parent / "pytorch" / "trainer" / "connectors" / "accelerator_connector.py").read_text()
    source = re.sub(r"\"\s*\n\s*(?:rf|f|r)?\"", "", source)  # adjacent string literals, joined as Python does
    assert len(quoted) >= 15
    for message in quoted:
        fixed = max(re.split(r"\{[^}]*\}|`|\.\.\.|='[^']*'", message), key=len).strip(" .,;:()")
        assert len(fixed) >= 12 and fixed in source, message
