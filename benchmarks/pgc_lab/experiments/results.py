"""What a job leaves in its output folder, and :class:`JobResult`, the only reader of those files.

The writers are the callbacks of :mod:`pgc_lab.experiments.callbacks`; they take every file name from
:data:`FILES`, so this module is the one place that knows the layout:

- ``spec.json``: the job spec as launched (written by :func:`~pgc_lab.experiments.launch`);
- ``job.yaml``: the LightningCLI config the job ran (``lightning-pgc fit --config <recipe> --config job.yaml``
  reproduces it);
- ``job.log``: stdout and stderr of every rank; ``job_done.json``: exit status and wall time of the launch;
- ``rank{k}.json`` from every rank: final step, parameter checksum, whether every floating-point
  parameter and buffer is finite, skipped steps, injected sleep, batch sizes,
  message-buffer high-water marks, ``rank_stats`` (when the strategy has them), ``measure`` (with ``measure``),
  ``resources`` (with ``resources``: resident memory and thread count after given steps and at the end);
- ``valve_rank{k}.json`` from every rank with a :class:`~lightning_pgc.StalenessValve`;
- ``curve.csv`` (rank 0): wall seconds since the first step, step, training loss on the mean scale of all ranks;
- ``val_curve.csv`` (rank 0, with ``val_every_n_steps``): wall seconds on the validation clock, step, loss,
  accuracy, seconds the evaluation took;
- ``summary.json`` (rank 0): final metrics, fit wall time, global step, diagnostics history, the validation
  curve and the offset between the two clocks;
- ``wandb_run.json`` (rank 0, with W&B): the run's folder, id, name, group, project and config;
- ``progress.txt`` (rank 0): the last step reached, every 10 steps (read by progress bars while it runs).
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

__all__ = ["FILES", "JobResult", "RunRecords", "read_result", "rank_file", "valve_file"]

FILES: dict[str, str] = {
    "spec": "spec.json",
    "config": "job.yaml",
    "log": "job.log",
    "done": "job_done.json",
    "curve": "curve.csv",
    "val_curve": "val_curve.csv",
    "summary": "summary.json",
    "wandb": "wandb_run.json",
    "progress": "progress.txt",
    "checkpoints": "checkpoints",
}

CURVE_HEADER = "wall_s,step,train_loss"
VAL_CURVE_HEADER = "wall_s,step,val_loss,val_acc,eval_s"


def rank_file(rank: int) -> str:
    """Name of rank ``rank``'s result file."""
    return f"rank{rank}.json"


def valve_file(rank: int) -> str:
    """Name of rank ``rank``'s staleness-valve record."""
    return f"valve_rank{rank}.json"


@dataclass
class JobResult:
    """Everything one job wrote, read back (see the module docstring for the files).

    ``ok`` is False when the launch failed or a file is missing; ``error`` then says why and the other fields
    hold what could be read.
    """

    out: Path
    ok: bool
    spec: dict[str, Any] = field(default_factory=dict)
    ranks: list[Optional[dict[str, Any]]] = field(default_factory=list)  # None: a rank killed by a fault
    valves: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    curve: list[tuple[float, int, float]] = field(default_factory=list)  # (wall_s, step, train_loss)
    val_curve: list[tuple[float, int, float, float, float]] = field(default_factory=list)  # + val loss, acc, eval s
    wandb: Optional[dict[str, Any]] = None
    job_wall_s: float = float("nan")  # the whole launch: process start to exit
    returncode: Optional[int] = None
    log_tail: str = ""
    error: str = ""

    @property
    def identical_replicas(self) -> bool:
        """Every rank that finished ended with the same parameter checksum."""
        return bool(self.ranks) and len({r["checksum"] for r in self.ranks if r is not None}) == 1

    @property
    def fit_wall_s(self) -> float:
        """Rank 0's fit wall time (first hook of ``fit`` to the end of training)."""
        return float(self.summary.get("fit_wall_s", float("nan")))

    @property
    def metrics(self) -> dict[str, float]:
        """Rank 0's ``trainer.callback_metrics`` after fit (scalars)."""
        return dict(self.summary.get("metrics", {}))

    @property
    def diagnostics(self) -> list[dict[str, float]]:
        """Rank 0's :class:`~lightning_pgc.PGCDiagnostics` history (empty without diagnostics)."""
        return list(self.summary.get("diagnostics", []))

    def train_on_val_clock(self) -> list[tuple[float, int, float]]:
        """The training curve with wall times shifted onto the validation curve's clock."""
        offset = float(self.summary.get("curve_offset_s", 0.0))
        return [(wall + offset, step, loss) for wall, step, loss in self.curve]

    def progress(self) -> int:
        """The last step the running job reported (0 before its first report)."""
        return read_progress(self.out)

    def legacy(self) -> dict[str, Any]:
        """The dict the earlier ``tests/jobs.run_job`` returned (``ranks``, ``valves``, ``summary`` with the spec,
        ``curve``, ``out``, ``stderr``), for callers written against it."""
        return {
            "ranks": self.ranks,
            "valves": self.valves,
            "summary": {"spec": self.spec, **self.summary},
            "curve": self.curve,
            "out": self.out,
            "stderr": self.log_tail,
        }


def read_progress(out: Path) -> int:
    """The last step a running job in ``out`` reported (0 before its first report)."""
    try:
        return int((Path(out) / FILES["progress"]).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _read_csv(path: Path, header: str, types: tuple[type, ...]) -> list[tuple[Any, ...]]:
    lines = path.read_text().splitlines()
    if not lines or lines[0] != header:
        raise ValueError(f"{path}: expected the header {header!r}")
    return [tuple(t(v) for t, v in zip(types, line.split(","))) for line in lines[1:]]


def read_result(out: Path | str, devices: Optional[int] = None) -> JobResult:
    """Read the job folder ``out`` (``devices``: how many rank files to expect; default from ``spec.json``)."""
    out = Path(out)
    result = JobResult(out=out, ok=False)
    try:
        if (out / FILES["spec"]).exists():
            result.spec = json.loads((out / FILES["spec"]).read_text())
        if (out / FILES["done"]).exists():
            done = json.loads((out / FILES["done"]).read_text())
            result.job_wall_s = float(done["job_wall_s"])
            result.returncode = int(done["returncode"])
        if (out / FILES["log"]).exists():
            result.log_tail = (out / FILES["log"]).read_text(errors="replace")[-8000:]
        if result.returncode not in (None, 0):
            result.error = f"the job exited with status {result.returncode}; see {out / FILES['log']}"
            return result
        n = int(devices if devices is not None else result.spec.get("devices", 1))
        # a rank the spec kills (SIGKILL) or terminates (SIGTERM) may write nothing: None in its place
        gone = {f["rank"] for f in result.spec.get("faults", ()) if f.get("kind") in ("Kill", "Terminate")}
        result.ranks = [
            json.loads((out / rank_file(r)).read_text()) if r not in gone or (out / rank_file(r)).exists() else None
            for r in range(n)
        ]
        if (out / valve_file(0)).exists():
            result.valves = [json.loads((out / valve_file(r)).read_text()) for r in range(n)]
        result.summary = json.loads((out / FILES["summary"]).read_text())
        result.curve = _read_csv(out / FILES["curve"], CURVE_HEADER, (float, int, float))  # type: ignore[assignment]
        if (out / FILES["val_curve"]).exists():
            result.val_curve = _read_csv(  # type: ignore[assignment]
                out / FILES["val_curve"], VAL_CURVE_HEADER, (float, int, float, float, float)
            )
        if (out / FILES["wandb"]).exists():
            result.wandb = json.loads((out / FILES["wandb"]).read_text())
    except (OSError, ValueError, KeyError) as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.ok = True
    return result


class RunRecords:
    """Finished runs' records, kept as append-only JSON Lines, one gzip-compressed file per book.

    A book is a set of runs that belong together (e.g. one round of a benchmark grid): ``<folder>/<book>.jsonl.gz``.
    Each line is one record, a JSON object whose ``"job"`` field names the run. Saving appends a line (a gzip
    member written in one call), so a file only grows; the newest line of a name is its record. A reader that finds
    a last member still being written ignores it.
    """

    SUFFIX = ".jsonl.gz"

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)
        self._books: dict[str, dict[str, dict[str, Any]]] = {}

    def path(self, book: str) -> Path:
        """The file of ``book``."""
        return self.folder / f"{book}{self.SUFFIX}"

    def books(self) -> list[str]:
        """The books present in the folder, sorted."""
        return sorted(p.name[: -len(self.SUFFIX)] for p in self.folder.glob(f"*{self.SUFFIX}"))

    def records(self, book: str) -> dict[str, dict[str, Any]]:
        """Every record of ``book`` by run name (the newest line of each name), in first-written order."""
        if book not in self._books:
            found: dict[str, dict[str, Any]] = {}
            try:
                data = self.path(book).read_bytes()
            except OSError:
                data = b""
            for member in _gzip_members(data):
                for line in member.decode().splitlines():
                    if line.strip():
                        record = json.loads(line)
                        found[record["job"]] = record
            self._books[book] = found
        return self._books[book]

    def get(self, book: str, name: str) -> Optional[dict[str, Any]]:
        """The record of run ``name`` in ``book`` (None if there is none)."""
        return self.records(book).get(name)

    def append(self, book: str, records: list[dict[str, Any]]) -> Path:
        """Add ``records`` (each with a ``"job"`` name) at the end of ``book``'s file, in one write."""
        self.folder.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(r, default=float, allow_nan=True) + "\n" for r in records)
        buffer = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as gz:  # mtime 0: reproducible bytes
            gz.write(text.encode())
        path = self.path(book)
        known = self.records(book)
        with open(path, "ab") as f:
            f.write(buffer.getvalue())
        for r in records:
            known[r["job"]] = json.loads(json.dumps(r, default=float, allow_nan=True))
        return path


def _gzip_members(data: bytes) -> Iterator[bytes]:
    """The decompressed members of a (multi-member) gzip stream; a truncated last member is left out."""
    while data:
        inflater = zlib.decompressobj(wbits=31)
        try:
            out = inflater.decompress(data)
        except zlib.error:
            return
        if not inflater.eof:
            return
        yield out
        data = inflater.unused_data
