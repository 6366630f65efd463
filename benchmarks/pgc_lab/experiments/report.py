"""The one report writer of ``benchmarks/``: a results file (JSON), a markdown page or block, and plots, into docs/.

Every number a page of docs/ shows comes from the JSON written next to it, so a benchmark hands its whole result to
:func:`write_report` with the rendered markdown and its figures. A page a script owns whole is rewritten; a page
with prose around a generated block keeps the prose: only the text between the block's begin and end markers is
replaced (:func:`update_block`; the block is appended, under an optional heading, to a page without one yet).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

__all__ = ["Block", "replace_block", "save_figure", "update_block", "write_json", "write_report"]

#: A generated block: its text (markers included), its begin marker and its end marker.
Block = tuple[str, str, str]


def write_json(path: Path, payload: Any, newline: bool = False) -> Path:
    """``payload`` as indented JSON (numbers that are not JSON types, e.g. numpy floats, as floats; paths as text),
    ending with a newline if ``newline``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=_plain) + ("\n" if newline else ""))
    return path


def _plain(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def replace_block(text: str, block: str, begin: str, end: str, heading: str = "") -> str:
    """``text`` with the part from ``begin`` to ``end`` (markers included) replaced by ``block``, which carries the
    markers itself; without those markers, ``text`` followed by ``heading`` and ``block``."""
    if not (block.startswith(begin) and block.rstrip("\n").endswith(end)):
        raise ValueError(f"a generated block must start with {begin!r} and end with {end!r}")
    if begin in text and end in text.split(begin, 1)[1]:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + (heading + "\n\n" if heading else "") + block + "\n"


def update_block(path: Path, block: str, begin: str, end: str, title: str, heading: str = "") -> Path:
    """Replace the generated block of the page ``path`` (:func:`replace_block`); a missing page starts as ``title``."""
    text = path.read_text() if path.exists() else title.rstrip("\n") + "\n"
    path.write_text(replace_block(text, block, begin, end, heading))
    return path


def save_figure(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Save a matplotlib figure and close it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def write_report(
    docs: Path,
    name: str,
    result: Any,
    page: Optional[str] = None,
    block: Optional[Block] = None,
    markdown_name: Optional[str] = None,
    title: str = "",
    heading: str = "",
    figures: Optional[Mapping[str, Any]] = None,
    newline: bool = False,
) -> list[Path]:
    """Write one benchmark's report into ``docs`` and return the paths written.

    Args:
        docs: the folder (the repository's ``docs/``, or a test's temporary folder).
        name: the results file is ``<name>.json``; the page is ``<markdown_name or name>.md``.
        result: what the JSON holds (every number the page shows).
        page: the whole page, written as given (a page the script owns).
        block: ``(text, begin, end)``: only this block of the page is replaced (the prose around it is kept).
        title: the first line of a page that does not exist yet (with ``block``).
        heading: put above the block when the page has none yet.
        figures: file name in ``docs`` -> matplotlib figure (saved, then closed).
        newline: end the results file with a newline.
    """
    if page is not None and block is not None:
        raise ValueError("write_report takes either a whole page or a block of one, not both")
    written = [write_json(docs / f"{name}.json", result, newline=newline)]
    md = docs / f"{markdown_name or name}.md"
    if page is not None:
        md.write_text(page)
        written.append(md)
    elif block is not None:
        written.append(update_block(md, *block, title=title or f"# {name}", heading=heading))
    for file_name, fig in (figures or {}).items():
        written.append(save_figure(fig, docs / file_name))
    return written
