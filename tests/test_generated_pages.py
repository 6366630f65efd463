"""The pages and blocks that scripts generate are what each script renders from its results file: a generated
block's numbers are checked by regenerating it, not by rows of docs/results/numbers.csv (``pgc_lab.numbers``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"


def test_benchmarks_block_is_what_grid_renders_from_benchmarks_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import grid

    result = json.loads((RESULTS / "benchmarks.json").read_text())
    text = (RESULTS / "benchmarks.md").read_text()
    block = text[text.index(grid.MARK_BEGIN) : text.index(grid.MARK_END) + len(grid.MARK_END)]
    assert block == grid.render_markdown(result, result["table"])


@pytest.mark.parametrize("stem", ["demo", "demo_full"])
def test_demo_page_is_what_the_demo_renders_from_demo_json(stem: str) -> None:
    """demo.md (``make demo``) and demo_full.md (``--arms all``, the full race), each from its own json."""
    from pgc_lab import demo

    saved = json.loads((RESULTS / f"{stem}.json").read_text())
    args = demo.parse_args([])
    args.__dict__.update(saved["settings"])
    assert demo.DOCS_STEMS[args.arms] == stem
    outcomes = demo.read_outcomes(saved["results"])
    assert demo.page(outcomes, args, saved["command"]) == (RESULTS / f"{stem}.md").read_text()


def test_staleness_emulated_page_is_what_its_script_renders_from_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import staleness_emulated as se

    summary = json.loads((RESULTS / "staleness_emulated.json").read_text())
    assert se.render(summary) == (RESULTS / "staleness_emulated.md").read_text()
    assert se.summarize(se.read_records(se.RECORDS)) == summary  # the summary is the records'


def test_tasks_page_is_what_its_script_renders_from_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import task_sensitivity as ts

    results = json.loads((RESULTS / "task_sensitivity.json").read_text())
    assert ts.render(results) == (RESULTS / "tasks.md").read_text()


def test_math_conditioning_table_is_tandon_conditions_json() -> None:
    saved = json.loads((RESULTS / "tandon_conditions.json").read_text())
    text = (DOCS / "math.md").read_text()
    table = text[text.index("| n | s | C(n,s) |") :].split("\n\n")[0].splitlines()
    assert len(table) == 2 + len(saved["rows"])  # header, separator, one line per saved row: nothing else
    for row in saved["rows"]:
        cells = [
            str(row["n"]),
            str(row["s"]),
            str(row["subsets_total"]),
            "all" if row["exact"] else f"{row['subsets_checked']} sampled",
            f"{row['worst_condition']:.2g}",
            str(row["seed_used"]),
            f"{row['single_seed_spread']:.0f}x",
            "yes" if row["admitted"] else "**no**",
        ]
        assert "| " + " | ".join(cells) + " |" in text, cells


def _block(text: str, begin: str, end: str) -> str:
    return text[text.index(begin) : text.index(end) + len(end)]


def test_bounded_staleness_blocks_are_what_the_benchmark_renders_from_their_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bounded_staleness as bs

    text = (RESULTS / "bounded_staleness.md").read_text()
    for name, results in (("bounded", "bounded_staleness.json"), ("bounded-choice", "bounded_choice.json")):
        assert _block(text, *bs.MARKS[name]) == bs.render_markdown(json.loads((RESULTS / results).read_text())), name


def test_emulated_map_blocks_are_what_the_renderer_makes_from_their_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import emulated_render as er

    from pgc_lab.map.rounds import is_complete, shipped_summary

    shipped = shipped_summary()  # the full round once it is complete, else the reduced one
    source = shipped.relative_to(ROOT).as_posix()
    summary = json.loads(shipped.read_text())
    assert is_complete(summary), source
    grid = json.loads((RESULTS / "grid_map.json").read_text())
    assert _block((RESULTS / "benchmarks.md").read_text(), er.BEGIN, er.END) == er.render(summary, source, grid)
    cost = _block((RESULTS / "emulator.md").read_text(), er.COST_BEGIN, er.COST_END)
    assert cost == er.render_cost(summary["cost"], source)


def test_simulation_blocks_are_what_the_simulator_scripts_render_from_their_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sim_grid
    import sim_validate

    text = (RESULTS / "simulation.md").read_text()
    validation = json.loads((RESULTS / "sim_validation.json").read_text())
    assert _block(text, sim_validate.MARK_BEGIN, sim_validate.MARK_END) == sim_validate.render(validation)
    grid = json.loads((RESULTS / "sim_grid.json").read_text())
    assert _block(text, sim_grid.MARK_BEGIN, sim_grid.MARK_END) == sim_grid.render(grid, grid["command"])


def test_advise_and_end_to_end_blocks_are_what_their_scripts_render_from_their_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import advise_trace
    import validate_e2e

    out = json.loads((RESULTS / "advise_slow_rank.json").read_text())
    trace = json.loads((RESULTS / "advise_trace.json").read_text())
    guide = (DOCS / "guide.md").read_text()
    assert _block(guide, advise_trace.MARK_BEGIN, advise_trace.MARK_END) == advise_trace.guide_block(out, trace)
    e2e = json.loads((RESULTS / "validation_e2e.json").read_text())
    page = (RESULTS / "emulator.md").read_text()
    assert _block(page, validate_e2e.MARK_BEGIN, validate_e2e.MARK_END) == validate_e2e.render(e2e)


@pytest.mark.parametrize("name", ["step_time", "stall"])
def test_measured_pages_are_what_their_benchmark_renders_from_their_json(name: str) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    module = __import__(name)
    assert (
        module.render_markdown(json.loads((RESULTS / f"{name}.json").read_text()))
        == (RESULTS / f"{name}.md").read_text()
    )


def test_the_data_plane_page_is_what_the_benchmark_renders_from_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_time

    page = step_time.render_planes_markdown(json.loads((RESULTS / "step_time_planes.json").read_text()))
    assert page == (RESULTS / "step_time_planes.md").read_text()


def test_the_added_passes_page_is_what_its_benchmark_renders_and_reads_the_plane_it_cites() -> None:
    """The pass timings sit beside the gap measured on the data plane: the gap they quote is that file's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_passes

    passes = json.loads((RESULTS / "step_time_passes.json").read_text())
    assert step_passes.render(passes) == (RESULTS / "step_time_passes.md").read_text()
    planes = json.loads((RESULTS / "step_time_planes.json").read_text())["seconds_per_step"]
    for model, (pgc, ddp) in step_passes.PAIRS.items():
        gap = [(a - b) * 1e3 for a, b in zip(planes[pgc], planes[ddp])]
        assert passes["models"][model]["measured_gap_ms"] == pytest.approx(gap)


def test_the_gpu_check_page_is_what_its_benchmark_renders_from_its_json() -> None:
    """Every number of docs/results/gpu_check.md (measured on one GPU) is rendered from docs/results/gpu_check.json."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    result = json.loads((RESULTS / "gpu_check.json").read_text())
    assert gpu_check.render(result) == (RESULTS / "gpu_check.md").read_text()
    assert gpu_check.merge([result]) == result  # (a merged file merges to itself)


def test_the_rejoin_page_is_what_its_benchmark_renders_from_its_results_file() -> None:
    """docs/results/rejoin.md (state transfer from 1 M to 100 M parameters) is rendered from docs/results/rejoin.json."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import rejoin

    result = json.loads((RESULTS / "rejoin.json").read_text())
    assert rejoin.render(result) == (RESULTS / "rejoin.md").read_text()


def test_the_auto_page_is_what_its_benchmark_renders_from_its_results_file() -> None:
    """docs/results/auto.md (pgc_auto against ddp and the fixed arms) is rendered from docs/results/auto.json."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import auto

    result = json.loads((RESULTS / "auto.json").read_text())
    assert auto.render(result) == (RESULTS / "auto.md").read_text()


def test_the_memory_page_is_what_its_benchmark_renders_from_its_results_file() -> None:
    """docs/results/memory.md (every rank's peak RSS under ddp and each scheme) is rendered from docs/results/memory.json."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory

    result = json.loads((RESULTS / "memory.json").read_text())
    assert memory.render(result) == (RESULTS / "memory.md").read_text()
    assert memory.add_goals([dict(r) for r in result["runs"]]) == result["runs"]  # (the goals follow from the runs)


@pytest.mark.parametrize("report", ["staleness", "staleness_bounded", "staleness_exponential", "staleness_stalls"])
def test_staleness_pages_are_what_the_benchmark_renders_from_their_json(report: str) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import staleness

    saved = json.loads((RESULTS / f"{report}.json").read_text())
    assert staleness.render(saved) == (RESULTS / f"{report}.md").read_text()


def test_the_safety_valve_page_is_what_its_benchmark_renders_from_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import safety_valve

    saved = json.loads((RESULTS / "safety_valve.json").read_text())
    assert safety_valve.render(saved) == (RESULTS / "safety_valve.md").read_text()


def test_the_hard_tasks_page_is_what_its_script_renders_from_the_hard_rounds_summary() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hard_render

    source = RESULTS / "emulated_map_hard.json"
    text = (RESULTS / "hard_tasks.md").read_text()
    block = text[text.index(hard_render.BEGIN) : text.index(hard_render.END) + len(hard_render.END)]
    assert block == hard_render.render(json.loads(source.read_text()), str(source))
    guide = (DOCS / "guide.md").read_text()
    block = guide[
        guide.index(hard_render.GUIDE_BEGIN) : guide.index(hard_render.GUIDE_END) + len(hard_render.GUIDE_END)
    ]
    assert block == hard_render.guide_block(json.loads(source.read_text()))


def test_a_hard_cell_where_ddp_missed_on_every_seed_gets_no_verdict_and_never_keep_ddp() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hard_render

    summary = json.loads((RESULTS / "emulated_map_hard.json").read_text())
    missed = [c for c in summary["cells"] if c["ddp_missed"]]
    assert missed, "the shipped hard round has a cell where ddp missed on every seed"
    rows = {line for line in hard_render.guide_block(summary).splitlines() if line.startswith("| ")}
    for c in missed:
        row = next(
            r for r in rows if r.startswith(f"| {c['cell']['task']} | {c['cell']['n']} | {c['cell']['pattern']} |")
        )
        assert "no verdict" in row and "keep `ddp`" not in row
        fastest = min(
            (a for a in c["arms"] if a["arm"] != "ddp" and a["reached_late"] == a["seeds"]),
            key=lambda a: a["rmean_late_s"],
        )
        assert f"the fastest {fastest['arm']} at most {fastest['vs_ddp_late']['ratio']:.2f}x" in row
        assert "nothing is ranked" in "\n".join(hard_render.cell_lines(c))
    kept = [c for c in summary["cells"] if not c["ddp_missed"] and c.get("winner") is None]
    assert kept and all(
        "keep `ddp`" in next(r for r in rows if f"| {c['cell']['pattern']} |" in r and f"| {c['cell']['task']} |" in r)
        for c in kept
    )


def test_the_reduced_rounds_timing_paragraph_is_what_its_script_renders_from_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import reduced_timing

    results = json.loads(reduced_timing.RESULTS.read_text())
    text = (RESULTS / "emulator.md").read_text()
    block = text[text.index(reduced_timing.BEGIN) : text.index(reduced_timing.END) + len(reduced_timing.END)]
    assert block == reduced_timing.block(results)
    assert (
        results["wall_s"] < 30 * 60 and results["items"] == json.loads(reduced_timing.SHIPPED.read_text())["items_done"]
    )
