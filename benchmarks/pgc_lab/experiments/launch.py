"""``launch(spec) -> JobResult``: run one job on real processes through ``lightning-pgc fit`` and read it back.

:func:`launch_script` is the same launcher for a benchmark's own minimal Lightning script (the data-plane
measurements of ``benchmarks/step_time.py``, ``stall.py`` and ``gpu_check.py``, which must not carry the harness's
recorder callbacks): it runs the script on real ranks and reads back what each rank wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import yaml

from pgc_lab.experiments.results import FILES, JobResult, read_progress, read_result
from pgc_lab.experiments.spec import job_config, recipe_path, resolve_spec

__all__ = ["JobFailed", "command", "launch", "launch_script"]

#: Files of an earlier run in the same folder that must not be mistaken for this run's.
STALE = ("progress", "summary", "curve", "val_curve", "done", "wandb")

#: Environment variables of an enclosing distributed run that would make the job think it is a rank of it.
INHERITED = (
    "LOCAL_RANK",
    "NODE_RANK",
    "WORLD_SIZE",
    "GLOBAL_RANK",
    "RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
    "LIGHTNING_PGC_TRACEBACK",
    "PGC_STORE_ADDR",
)


class JobFailed(RuntimeError):
    """A job exited with a non-zero status or left incomplete results (``result`` holds what was read)."""

    def __init__(self, result: JobResult) -> None:
        super().__init__(f"job in {result.out} failed: {result.error}\n{result.log_tail[-6000:]}")
        self.result = result


#: the folder that holds the lab package: a job's config names the lab's callbacks, so its ranks import them
LAB_PATH = str(Path(__file__).resolve().parents[2])


def lab_pythonpath(env: Mapping[str, str]) -> str:
    """``PYTHONPATH`` for a process that imports the lab: the lab's folder first, then what ``env`` had."""
    return os.pathsep.join(p for p in (LAB_PATH, env.get("PYTHONPATH", "")) if p)


def command(spec: dict[str, Any]) -> list[str]:
    """The command line a job runs (its ranks 1..n-1 are started by Lightning re-running it)."""
    spec = resolve_spec(spec)
    out = Path(spec["out"]).resolve()
    return [
        sys.executable,
        "-m",
        "lightning_pgc",
        "fit",
        "--config",
        str(recipe_path(spec["recipe"])),
        "--config",
        str(out / FILES["config"]),
    ]


def launch(
    spec: dict[str, Any],
    timeout: Optional[float] = None,
    check: bool = True,
    on_progress: Optional[Callable[[int], None]] = None,
) -> JobResult:
    """Run the job ``spec`` (see :mod:`pgc_lab.experiments.spec`) and return what it wrote.

    Writes ``spec.json`` and ``job.yaml`` into ``spec["out"]``, runs ``python -m lightning_pgc fit --config
    <recipe> --config job.yaml`` there with every rank's output in ``job.log``, and reads the result files.

    Args:
        spec: the job spec; ``out`` is created if missing, earlier results in it are removed first.
        timeout: seconds before the job is killed (``None``: no limit).
        check: raise :class:`JobFailed` when the job fails; otherwise return a result with ``ok=False``.
        on_progress: called about twice a second with the last step the job reported.

    Raises:
        JobFailed: with ``check``, a non-zero exit status or missing result files.
        subprocess.TimeoutExpired: the job ran past ``timeout`` (it is killed first).
        KeyError: an unknown spec key.
    """
    spec = resolve_spec(spec)
    out = Path(spec["out"]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(out)}
    for key in STALE:
        (out / FILES[key]).unlink(missing_ok=True)
    (out / FILES["spec"]).write_text(json.dumps(spec, indent=1))
    (out / FILES["config"]).write_text(yaml.safe_dump(job_config(spec), sort_keys=False))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(spec["threads"]),
        "PYTHONWARNINGS": "ignore",
        # W&B without its system-metrics sampler and console capture: they would compete with the ranks for CPU
        "WANDB_SILENT": "true",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_CONSOLE": "off",
        "PYTHONPATH": lab_pythonpath(os.environ),
    }
    for key in INHERITED:
        env.pop(key, None)
    online = bool(spec["wandb"]) and not spec["wandb"].get("offline", True)
    env.setdefault("WANDB_MODE", "online" if online else "offline")
    started = time.monotonic()
    with open(out / FILES["log"], "w") as log:
        proc = subprocess.Popen(command(spec), cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if timeout is not None and time.monotonic() - started > timeout:
                    raise subprocess.TimeoutExpired(proc.args, timeout)
                time.sleep(0.2 if on_progress is None else 0.5)
                if on_progress is not None:
                    on_progress(read_progress(out))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wall = time.monotonic() - started
    (out / FILES["done"]).write_text(json.dumps({"returncode": proc.returncode, "job_wall_s": wall}))
    result = read_result(out, devices=int(spec["devices"]))
    if check and not result.ok:
        raise JobFailed(result)
    return result


def launch_script(
    script: Path,
    args: Sequence[str],
    out: Path,
    ranks: int,
    one_process_per_rank: bool = False,
    rank_env: Optional[Callable[[int], Mapping[str, str]]] = None,
    threads: int = 1,
    timeout: float = 1800,
) -> list[dict[str, Any]]:
    """Run ``python SCRIPT --worker --out OUT ARGS`` on ``ranks`` processes; return each rank's ``OUT/rank{r}.json``.

    Args:
        script: a script whose ``--worker`` mode runs one ``Trainer.fit`` and writes ``rank{global rank}.json``.
        args: its other arguments.
        out: the folder the ranks write to (created; earlier rank files in it are removed first).
        ranks: how many ranks.
        one_process_per_rank: start every rank here as a one-device node (``NODE_RANK``, ``WORLD_SIZE``,
            ``MASTER_ADDR``/``MASTER_PORT`` of a free local port), e.g. one GPU each through ``rank_env``; by
            default the script is started once and Lightning's launcher starts ranks 1..n-1 by re-running it.
        rank_env: extra environment of rank ``r`` (with ``one_process_per_rank``), e.g. ``CUDA_VISIBLE_DEVICES``.
        threads: ``OMP_NUM_THREADS`` of every rank.
        timeout: seconds before the ranks are killed.

    Raises:
        RuntimeError: a rank exited with a non-zero status (with the tail of its output).
        TimeoutError: the ranks ran past ``timeout`` (all of them are killed).
    """
    out.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        (out / f"rank{r}.json").unlink(missing_ok=True)
    cmd = [sys.executable, str(script), "--worker", "--out", str(out), *args]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": lab_pythonpath(os.environ),
    }
    for key in INHERITED:
        env.pop(key, None)
    if not one_process_per_rank:
        # a process group of its own: a timeout kills every rank (Lightning's launcher starts ranks 1..n-1 as children)
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise TimeoutError(
                f"{script.name} {' '.join(args)} ran past {timeout:g} s (every rank killed):\n{stderr[-4000:]}"
            ) from None
        if proc.returncode != 0:
            raise RuntimeError(f"{script.name} {' '.join(args)} failed:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    else:
        port = _free_port()
        procs = []
        for r in range(ranks):
            node = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(r), "LOCAL_RANK": "0"}
            rank = {**env, **node, "WORLD_SIZE": str(ranks), **(rank_env(r) if rank_env else {})}
            procs.append(subprocess.Popen(cmd, env=rank, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        try:
            logs = [p.communicate(timeout=max(0.0, deadline - time.monotonic()))[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            logs = [p.communicate()[0] for p in procs]
            raise TimeoutError(
                f"{script.name} {' '.join(args)} ran past {timeout:g} s (every rank killed):\n"
                + "\n".join(log[-3000:] for log in logs)
            ) from None
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{script.name} {' '.join(args)} failed:\n" + "\n".join(log[-3000:] for log in logs))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
