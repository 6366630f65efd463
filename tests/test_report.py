"""The report writer of benchmarks/: JSON results files and generated blocks of markdown pages."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pgc_lab.experiments.report import replace_block, update_block, write_json

BEGIN, END = "<!-- x:begin -->", "<!-- x:end -->"


def test_a_results_file_reads_back_as_written_and_ends_as_asked(tmp_path: Path) -> None:
    payload = {"ratio": np.float64(0.5), "rows": [1, 2.25, None], "path": Path("docs/x.json")}
    plain = write_json(tmp_path / "a" / "plain.json", payload)
    ended = write_json(tmp_path / "ended.json", payload, newline=True)
    assert json.loads(plain.read_text()) == {"ratio": 0.5, "rows": [1, 2.25, None], "path": "docs/x.json"}
    assert not plain.read_text().endswith("\n")
    assert ended.read_text() == plain.read_text() + "\n"


def test_a_block_is_replaced_and_the_prose_around_it_kept(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"# Page\n\nbefore\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    update_block(page, f"{BEGIN}\nnew\n{END}", BEGIN, END, title="# unused")
    assert page.read_text() == f"# Page\n\nbefore\n\n{BEGIN}\nnew\n{END}\n\nafter\n"


def test_a_page_without_the_block_gets_it_appended_under_the_heading(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Page\n\nprose\n\n")
    update_block(page, f"{BEGIN}\nnew\n{END}", BEGIN, END, title="# unused", heading="## Generated")
    assert page.read_text() == f"# Page\n\nprose\n\n## Generated\n\n{BEGIN}\nnew\n{END}\n"
    missing = update_block(tmp_path / "new.md", f"{BEGIN}\nnew\n{END}", BEGIN, END, title="# New")
    assert missing.read_text() == f"# New\n\n{BEGIN}\nnew\n{END}\n"


def test_a_block_without_its_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="must start with"):
        replace_block(f"{BEGIN}\nold\n{END}", "no markers", BEGIN, END)
