"""Markers of the suite, applied in one place.

- ``realrank``: the test starts ranks as real processes (LightningCLI jobs, Trainer fits on several processes,
  launchers, wheel installs). These wait on process start-up, sockets and sleeps, and are timing-sensitive on a
  loaded machine.
- ``slow``: a single-process test that takes more than a few seconds.

``make test`` runs everything; ``make test-fast`` (``-m "not realrank and not slow"``) runs the rest. The shared
scenario helpers are plain modules next to this file: ``tests/runtime_scenarios.py`` (the PGC runtime on
in-process queues), ``tests/bounded_scenarios.py`` (the bounded-staleness coordinator) and ``tests/jobs.py``
(one job through the experiments harness).

A whole module is listed by its file name, a single test by ``file::function`` (every parametrization of it).
Collecting a listed module that lacks a listed test is an error, so a renamed test cannot silently lose its mark.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REALRANK = {
    "test_auto_ranks.py",
    "test_bounds_ranks.py",
    "test_cli.py",
    "test_demo.py",
    "test_faults.py",
    "test_leader_faults.py",
    "test_packaging.py",
    "test_resume.py",
    "test_state_transfer.py",
    "test_strategy.py",
    "test_trainer_calls.py",
    "test_bounded.py::test_real_ranks_persistent_slow_rank_bounded_ages_identical_replicas_and_window_valve",
    "test_compat.py::test_features_work_with_identical_replicas",
    "test_compat.py::test_bf16_and_max_time_work_and_diagnostics_ignore_log_every_n_steps",
    "test_diverged.py::test_a_real_job_whose_every_gradient_turns_nan_fails_fast_saying_it_diverged",
    "test_grid.py::test_tiny_job_logs_one_offline_wandb_run",
    "test_grid_map.py::test_smoke_grid_two_steps_per_cell_real_jobs",
    "test_loaders.py::test_every_case_reaches_training_step_as_under_ddp",
    "test_readme.py::test_the_readme_example_runs_as_pasted",
    "test_seed_experiment.py::test_slurm_and_torchrun_scripts",
    "test_staleness.py::test_each_correction_on_4_real_ranks_keeps_replicas_identical_and_trains",
    "test_stragglers.py::test_injector_with_two_process_ddp",
    "test_emulator_validation.py",
    "test_advise.py::test_step_trace_under_ddp_names_the_slow_rank",
    "test_theory.py::test_in_run_theory_estimates_and_valve_on_a_real_4_process_job",
}
SLOW = {
    "test_codes.py::test_condition_check_refuses_ill_conditioned_tandon",
    "test_generated_pages.py::test_benchmarks_block_is_what_grid_renders_from_benchmarks_json",
    "test_theory.py::test_valve_lowers_the_lr_and_otherwise_leaves_training_unchanged",
}


def _marks(table: set[str], item: pytest.Item) -> bool:
    module = item.path.name
    function = getattr(item, "originalname", item.name)
    return module in table or f"{module}::{function}" in table


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    whole = not any("::" in arg for arg in config.args)
    seen = {(item.path.name, getattr(item, "originalname", item.name)) for item in items}
    modules = {module for module, _ in seen}
    for entry in REALRANK | SLOW:
        if not (Path(__file__).parent / entry.split("::")[0]).is_file():
            raise pytest.UsageError(f"tests/conftest.py marks {entry}, whose module does not exist")
        if "::" in entry:
            module, function = entry.split("::")
            if whole and module in modules and (module, function) not in seen:
                raise pytest.UsageError(f"tests/conftest.py marks {entry}, which does not exist")
    for item in items:
        if _marks(REALRANK, item):
            item.add_marker(pytest.mark.realrank)
        if _marks(SLOW, item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def one_thread():
    """torch on one thread for the test: the emulator's small batched kernels run best so (and leave the other core
    to the machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
