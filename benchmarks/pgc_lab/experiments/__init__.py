"""The experiments harness: one way to launch a job, one reader of its results, one set of curve helpers.

- :func:`launch` (``launch.py``): a job spec -> a LightningCLI config on top of a recipe -> ``lightning-pgc fit``
  on real processes -> :class:`JobResult`;
- :mod:`~pgc_lab.experiments.spec`: the spec keys and :func:`job_config`;
- :mod:`~pgc_lab.experiments.results`: the result files (the only module that names them) and
  :class:`JobResult` / :func:`read_result`;
- :mod:`~pgc_lab.experiments.callbacks`: the measurement callbacks the job config lists;
- :mod:`~pgc_lab.experiments.curves`: ``smoothed``, ``first_crossing`` (one meaning: the fractional index
  at which a piecewise-linear curve first reaches the target), ``at_index``, ``crossing``, ``interpolate``,
  ``cumulative_at``;
- :mod:`~pgc_lab.experiments.stats`: paired confidence intervals over seeds (t and bootstrap), time to a
  target validation loss, values at equal wall time, throughput on several ranks (``seconds_per_step``);
- :mod:`~pgc_lab.experiments.runs`: a grid run read back and every column measured on it;
- :mod:`~pgc_lab.experiments.crossover`: the map grid's plan, run records and per-cell statistics;
- :mod:`~pgc_lab.experiments.report`: the one report writer of ``benchmarks/`` (JSON, markdown, plots).

The demo (:mod:`pgc_lab.demo`), ``benchmarks/`` and the tests all launch jobs through :func:`launch`; the
data-plane benchmarks run their own minimal script through :func:`~pgc_lab.experiments.launch.launch_script`.
Not imported by ``import lightning_pgc``.
Needs the ``[examples]`` extra (LightningCLI's jsonargparse, the digits data).
"""

from pgc_lab.experiments.curves import at_index, crossing, cumulative_at, first_crossing, interpolate, smoothed
from pgc_lab.experiments.launch import JobFailed, command, launch
from pgc_lab.experiments.results import FILES, JobResult, read_result
from pgc_lab.experiments.spec import DEFAULTS, job_config

__all__ = [
    "DEFAULTS",
    "FILES",
    "JobFailed",
    "JobResult",
    "at_index",
    "command",
    "crossing",
    "cumulative_at",
    "first_crossing",
    "interpolate",
    "job_config",
    "launch",
    "read_result",
    "smoothed",
]
