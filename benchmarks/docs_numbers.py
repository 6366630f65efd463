"""Rebuild the rows of docs/results/numbers.csv for the pages given (``pgc_lab.numbers``: what a row is).

    python benchmarks/docs_numbers.py README.md docs/guide.md     # after editing these pages or rerunning a result
    python benchmarks/docs_numbers.py docs/guide.md --source docs/results/auto.json#overhead.ratios
    python benchmarks/docs_numbers.py                             # every page

Each number a page shows keeps the source of its row. A number whose row no longer stands (its line changed) takes
the source of a row that stands no more (the first that holds it: in its section and showing the same number, in
its section, on its page and showing the same number, on its page; each such row serves once), else of a
``--source`` given, narrowed to the key path of the number shown where it names several. Every context is written
again: whole words of the line around the number, at least three, found once in its section. A number that no source
holds, or a row whose source no longer holds its number, is listed and nothing is written (exit 1): give its source
with ``--source file#key``, or fix the page.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

from pgc_lab.numbers import (
    ROOT,
    TABLE,
    SUMMARIES,
    UNITS,
    Found,
    Page,
    Row,
    load,
    named,
    numbers,
    occurrences,
    pages,
    place,
    read_page,
    read_table,
    select,
    shows,
    source_values,
)

SPECIAL = re.compile(r"[.*?\[\]@#]")  # what a key in a source cannot hold as is: "?" stands for it


def contexts(page: Page) -> dict[Found, str]:
    """Each number's context: whole words of its line, at least three (the line where it has fewer), found once in
    its section. The same numbers before it in its context share that context: rows of one context and number name
    its occurrences in order."""
    out: dict[Found, str] = {}
    by_line: dict[int, list[Found]] = {}
    for f in page.found:
        by_line.setdefault(f.line, []).append(f)
    for k, founds in by_line.items():
        line, section = page.lines[k - 1], [page.lines[j - 1] for j in page.sections[founds[0].section]]
        words = [m.span() for m in re.finditer(r"\S+", line)]
        for f in founds:
            w = next(i for i, (a, b) in enumerate(words) if a <= f.start < b)
            lo = hi = w
            while True:
                text = line[words[lo][0] : words[hi][1]]
                if hi - lo >= min(2, len(words) - 1) and sum(len(occurrences(s, text)) for s in section) == 1:
                    break
                if hi + 1 < len(words) and (hi - w <= w - lo or lo == 0):
                    hi += 1
                elif lo > 0:
                    lo -= 1
                else:
                    raise ValueError(f"line {k} stands twice in its section: {line!r}")
            for g in founds:
                if g.token == f.token and words[lo][0] <= g.start < f.start:
                    out[g] = text  # the earlier same numbers share it, so that the rows name them in order
            out[f] = text
    return out


def narrowed(source: str, token: str) -> str:
    """A source naming several numbers, narrowed to the key path of the first that shows as ``token`` (records
    named by a short string field where one names them alone, else by index); the source itself otherwise."""
    citation, *asks = source.split("@")
    name, _, key = citation.partition("#")
    if name.endswith(".py") or any(a == "count" or a in SUMMARIES for a in asks) or len(source_values(source)) < 2:
        return source
    factor = 1.0
    for a in asks:
        factor *= UNITS[a]
    data, keys = load(ROOT / name), key.split(".")
    for path, node in select(data, keys):
        for leaf_path, leaf in _leaves(node, path):
            if shows(token, [v * factor for v in numbers(leaf)]):
                parts, x = [], data
                for depth, step in enumerate(leaf_path):
                    glob = depth >= len(keys) or any(c in keys[depth] for c in "*?[")
                    parts.append(_key(x, step) if glob else keys[depth])
                    x = x[step]
                candidate = "@".join([f"{name}#{'.'.join(parts)}", *asks])
                if [p for p, _ in select(data, parts)] == [leaf_path] and shows(token, source_values(candidate)):
                    return candidate
                return source
    return source


def _leaves(x, path: tuple):
    if isinstance(x, dict):
        return [leaf for k, v in x.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(x, list):
        return [leaf for i, v in enumerate(x) for leaf in _leaves(v, (*path, i))]
    return [(path, x)]


def _key(container, step) -> str:
    if isinstance(container, dict):
        return SPECIAL.sub("?", str(step))
    record = container[step]
    for v in record.values() if isinstance(record, dict) else []:
        if isinstance(v, str) and 0 < len(v) <= 40 and not SPECIAL.search(v) and not re.fullmatch(r"-?\d+", v):
            if sum(named(item, v) for item in container) == 1:
                return v
    return str(step)


def rebuild(where: str, rows: list[Row], extra: list[str]) -> tuple[list[Row], list[str]]:
    """A page's rows again, and what stops it: numbers no source holds, rows whose source does not hold theirs."""
    page = read_page(where, (ROOT / where).read_text())
    mine = [row for row in rows if row.page == where]
    placed, _ = place(page, mine)
    stale = [row for row in mine if row not in placed.values()]
    sources: dict[Found, str] = {}
    wrong: list[str] = []
    for f in page.found:
        if f in placed:
            sources[f] = placed[f].source
            if not _holds(f.token, placed[f].source):
                wrong.append(f"{where}:{f.line}: {f.token}: {placed[f].source} no longer holds it")
            continue
        near = sorted(stale, key=lambda r: (r.section != f.section, r.number != f.token))
        used = next((r for r in near if _holds(f.token, r.source)), None)
        found = used.source if used else next((s for s in extra if _holds(f.token, s)), None)
        if found is None:
            wrong.append(f"{where}:{f.line}: {f.token} ({f.section!r}): no source holds it; give one with --source")
        else:
            sources[f] = narrowed(found, f.token)
            if used:
                stale.remove(used)
    text = contexts(page)
    return [Row(where, f.section, text[f], f.token, sources.get(f, "")) for f in page.found], wrong


def _holds(token: str, source: str) -> bool:
    try:
        return shows(token, source_values(source))
    except (KeyError, ValueError, OSError):
        return False


def write_table(rows: list[Row]) -> None:
    with open(TABLE, "w", newline="") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(Row._fields)
        out.writerows([r.page, r.section, r.context, r.number, r.source] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", help="pages, from the repository's root (default: every page)")
    parser.add_argument(
        "--source", action="append", default=[], help="file#key a new number may be read from (repeat it for more)"
    )
    args = parser.parse_args(argv)
    known = pages()
    chosen = args.pages or known
    unknown = [p for p in chosen if p not in known]
    if unknown:
        parser.error(f"not a guarded page: {', '.join(unknown)} (pages: {', '.join(known)})")
    rows, wrong = read_table(), []
    by_page = {p: [row for row in rows if row.page == p] for p in known}
    for where in chosen:
        by_page[where], problems = rebuild(where, rows, args.source)
        wrong += problems
    if wrong:
        print("\n".join(wrong), file=sys.stderr)
        print(f"{len(wrong)} numbers without a source that holds them: nothing written", file=sys.stderr)
        return 1
    write_table([row for p in known for row in by_page[p]])
    print(f"{TABLE.relative_to(ROOT)}: {sum(len(by_page[p]) for p in chosen)} rows of {len(chosen)} pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
