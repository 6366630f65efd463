"""Running a round of the emulated crossover map: incremental, resumable, one append-only JSON Lines file.

Every finished (cell, arm) appends one line (:func:`~lightning_pgc.emulator.cells.run_arm`'s record) to the round's
file and flushes it; a restarted round reads the file first and runs only what is missing. Work items run in
``workers`` forked processes (each with one torch thread); only the parent writes. A progress bar counts items.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from lightning_pgc.emulator.cells import MapArm, MapCell, Protocol, arms_for, run_arm

__all__ = ["done_keys", "item_key", "plan_items", "read_records", "run_round"]


def item_key(cell: MapCell, arm: MapArm, protocol: Protocol) -> str:
    """What identifies a work item (a record with the same key is not run again)."""
    fields = arm.correction_fields()  # empty for an uncorrected arm: its key is as before corrections existed
    replication = [arm.replication] if arm.bounded else []  # bounded staleness only: the other keys are unchanged
    proto = asdict(protocol)
    if not proto["extend"]:  # a protocol without the edge rule keeps the key it had before the rule existed
        del proto["extend"]
    if proto.get("val_every") == 1:  # validation after every version: the key it had before the interval existed
        del proto["val_every"]
    return json.dumps(
        {
            "cell": asdict(cell),
            "arm": [arm.strategy, arm.c, *replication, *fields.values()],
            "protocol": proto,
        },
        sort_keys=True,
        default=list,
    )


def read_records(path: Path | str) -> list[dict[str, Any]]:
    """Every complete record of a round file (a torn last line, from a killed run, is ignored)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def done_keys(records: Iterable[dict[str, Any]]) -> set[str]:
    return {r["key"] for r in records if "key" in r}


def plan_items(
    cells: Iterable[MapCell], protocol: Protocol, arms_of: Optional[Callable[[MapCell], list[MapArm]]] = None
) -> tuple[list[tuple[MapCell, MapArm]], list[str]]:
    """Every (cell, arm) of the round and the arms left out (with why); ``arms_of`` replaces the map's arms
    (:func:`~lightning_pgc.emulator.cells.arms_for`) with a round's own."""
    items: list[tuple[MapCell, MapArm]] = []
    skipped: list[str] = []
    for cell in cells:
        if arms_of is not None:
            items.extend((cell, arm) for arm in arms_of(cell))
            continue
        arms, why = arms_for(cell.n, None if cell.cs is None else list(cell.cs), cell.pattern)
        if cell.fixed is not None:  # a cell with the settings of real runs: the arms those runs had
            arms = [arm for arm in arms if arm.label in {label for label, _, _ in cell.fixed}]
        items.extend((cell, arm) for arm in arms)
        skipped.extend(f"n={cell.n}: {w}" for w in why)
    return items, sorted(set(skipped))


def _work(job: tuple[MapCell, MapArm, Protocol]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    cell, arm, protocol = job
    record = run_arm(cell, arm, protocol)
    record["key"] = item_key(cell, arm, protocol)
    return record


def run_round(
    path: Path | str,
    cells: Iterable[MapCell],
    protocol: Protocol = Protocol(),
    workers: int = 1,
    progress: bool = True,
    limit: Optional[int] = None,
    arms_of: Optional[Callable[[MapCell], list[MapArm]]] = None,
) -> int:
    """Run every missing (cell, arm) of the round into ``path``; returns how many ran (``limit``: at most that;
    ``arms_of``: the round's own arms per cell, see :func:`plan_items`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = done_keys(read_records(path))
    items, _ = plan_items(cells, protocol, arms_of)
    todo = [(c, a, protocol) for c, a in items if item_key(c, a, protocol) not in done]
    if limit is not None:
        todo = todo[:limit]
    if not todo:
        return 0
    from tqdm import tqdm

    bar = tqdm(
        total=len(items),
        initial=len(items) - len(todo),
        disable=not progress,
        unit="arm",
        desc=path.name,
        dynamic_ncols=True,
    )
    torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with open(path, "a") as f:
        if torn:  # a line cut short by a killed run: end it, so the next record starts on its own line
            f.write("\n")

        def write(record: dict[str, Any]) -> None:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.set_postfix_str(f"n={record['cell']['n']} {record['cell']['pattern']} {record['arm']['label']}")
            bar.update(1)

        if workers <= 1:
            for job in todo:
                write(_work(job))
        else:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                for record in pool.imap_unordered(_work, todo):
                    write(record)
    bar.close()
    return len(todo)
