"""README.md can be acted on: its example runs as pasted, its "Which strategy should I use" table is what
benchmarks/which_strategy.py renders from docs/which_strategy.json (and that file follows the map it names), and the
error messages docs/troubleshooting.md quotes are the ones the code raises."""

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


def test_the_readme_keeps_the_fresh_machine_commands():
    assert "make demo   #" in README and "make test   #" in README


def test_the_which_strategy_table_is_rendered_from_its_file():
    table = json.loads((ROOT / "docs" / "which_strategy.json").read_text())
    from lightning_pgc.strategy import REGISTERED

    which_strategy.check(table, set(REGISTERED))
    begin, end = README.index(which_strategy.MARK_BEGIN), README.index(which_strategy.MARK_END)
    assert README[begin : end + len(which_strategy.MARK_END)] == which_strategy.render(table)
    for row in [*table["rows"], table["default"]]:  # every evidence link lands on a heading of its page
        path, anchor = row["evidence"].split("#")
        slugs = {
            re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in (ROOT / path).read_text().splitlines()
            if line.startswith("#")
        }
        assert anchor in slugs, row["evidence"]


def _heading_slugs(path: str) -> set[str]:
    return {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in (ROOT / path).read_text().splitlines()
        if line.startswith("#")
    }


def test_a_guide_built_from_the_shipped_emulated_round_links_every_row_to_a_heading_of_the_rendered_map():
    """Switching README to the emulated map is one command: the rows built from the round the docs show link to
    headings that the renderer wrote (its per-n tables and its per-scheme section), and the block renders."""
    from lightning_pgc.emulator.rounds import shipped_summary
    from lightning_pgc.emulator.summary import n_heading, slug

    shipped = shipped_summary()
    summary = json.loads(shipped.read_text())
    table = which_strategy.build(summary, shipped.relative_to(ROOT).as_posix())
    from lightning_pgc.strategy import REGISTERED

    which_strategy.check(table, set(REGISTERED))
    ns = {c["cell"]["n"] for c in summary["cells"]}
    assert {row["evidence"] for row in table["rows"]} <= {f"docs/benchmarks.md#{slug(n_heading(n))}" for n in ns}
    for row in [*table["rows"], table["default"]]:
        path, anchor = row["evidence"].split("#")
        assert anchor in _heading_slugs(path), row["evidence"]
    block = which_strategy.render(table)
    assert "**emulated**" in block and block.count("](docs/benchmarks.md#") == len(table["rows"]) + 2


def test_a_round_that_is_not_finished_is_neither_rendered_nor_turned_into_the_guide(tmp_path):
    import emulated_render

    from lightning_pgc.emulator.rounds import is_complete

    summary = json.loads((ROOT / "docs" / "emulated_map_reduced.json").read_text())
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


def test_the_which_strategy_file_follows_the_map_it_was_derived_from():
    """The file is exactly what its rule derives from the map it names: the real map (``derive``) or a summary of
    the emulated map (``build``)."""
    table = json.loads((ROOT / "docs" / "which_strategy.json").read_text())
    source = json.loads((ROOT / table["source"]).read_text())
    if table["source"] == "docs/grid_map.json":
        assert table == which_strategy.derive(source)
    else:
        assert table["source"].startswith("docs/emulated_map_"), table["source"]
        assert table == which_strategy.build(source, table["source"])


def test_the_rule_recommends_only_an_arm_separated_from_ddp_and_dgd_in_every_cell():
    def arm(name, t, dgd_high, ddp_high):
        return {"arm": name, "time_to_target_s": t, "vs_dgd": {"high": dgd_high}, "vs_ddp": {"high": ddp_high}}

    cells = {
        "slowrank-sleep": {
            "status": "complete",
            "arms": [arm("gc_fr_c2", 5.0, 0.9, 0.9), arm("pgc_cr_c2", 4.0, 0.9, 1.1)],
        },
        "slowrank-real": {
            "status": "complete",
            "arms": [arm("gc_fr_c2", 6.0, 0.8, 0.8), arm("pgc_cr_c2", 3.0, 0.5, 0.5)],
        },
    }
    settings = {"sleep/gc_fr_c2": {"lr": 0.1, "momentum": 0.9}, "real/gc_fr_c2": {"lr": 0.1, "momentum": 0.9}}
    rows = which_strategy.derive({"cells": cells, "chosen_setting": settings})["rows"]
    assert [(r["strategy"], r["s"], r["lr"]) for r in rows] == [("gc_fr", 1, 0.1)]
    cells["slowrank-real"]["arms"][0]["vs_ddp"]["high"] = 1.0  # not separated from ddp in one cell: keep ddp
    rows = which_strategy.derive({"cells": cells, "chosen_setting": settings})["rows"]
    assert [(r["strategy"], r["s"], r["lr"]) for r in rows] == [("ddp", None, None)]


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
