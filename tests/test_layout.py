"""The package's layout as a user meets it: what ``import lightning_pgc`` loads, and where the public names live."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

#: the parts that only ``advise`` needs, which ``import lightning_pgc`` (and the CLI's start) must not load
RESEARCH = ("lightning_pgc.theory", "lightning_pgc.emulator")


def _loaded(statement: str) -> list[str]:
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in json.loads(out.stdout.splitlines()[-1]) if m.startswith("lightning_pgc")]


@pytest.mark.parametrize("statement", ["import lightning_pgc", "import lightning_pgc.cli"])
def test_import_lightning_pgc_loads_no_research_code(statement: str) -> None:
    loaded = _loaded(statement)
    assert "lightning_pgc.strategy" in loaded and "lightning_pgc.callbacks" in loaded  # the check sees the package
    research = [m for m in loaded if any(m == r or m.startswith(r + ".") for r in RESEARCH)]
    assert research == []


def test_the_research_code_is_where_it_was_left_out_from() -> None:
    """The modules the check above keeps out exist, so a rename cannot make it pass vacuously."""
    assert set(RESEARCH) <= set(_loaded("import " + ", ".join(RESEARCH)))


def test_public_names_are_importable_from_the_package_and_its_callbacks() -> None:
    import lightning_pgc
    import lightning_pgc.callbacks as callbacks
    from lightning_pgc.callbacks import faults, stragglers

    for name in lightning_pgc.__all__:
        assert getattr(lightning_pgc, name) is not None
    for name in ("PGCDiagnostics", "StalenessValve", "StragglerInjector", "parse_delay", "SlowRanks"):
        assert getattr(lightning_pgc, name) is getattr(callbacks, name)
    for name in ("Stall", "Freeze", "Kill", "Terminate", "NaNGradient"):
        assert getattr(callbacks, name) is getattr(faults, name)
    assert callbacks.StragglerInjector is stragglers.StragglerInjector


ROOT = Path(__file__).resolve().parents[1]


def test_recipes_live_at_the_top_level_and_resolve_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_pgc import recipe_files
    from lightning_pgc.cli import resolve_configs

    assert recipe_files.folder() == ROOT / "recipes"  # a checkout: beside the package
    assert not (ROOT / "lightning_pgc" / "recipes").exists()
    names = recipe_files.available()
    assert {"digits_cnn.yaml", "strategies/ddp.yaml", "stragglers/seeds.yaml"} <= set(names)
    monkeypatch.chdir(tmp_path)  # no recipe files here
    for name in names:
        assert resolve_configs(["fit", "--config", name]) == ["fit", "--config", str(ROOT / "recipes" / name)]
    assert resolve_configs(["--config=recipes/digits_cnn.yaml"]) == [f"--config={ROOT / 'recipes' / 'digits_cnn.yaml'}"]


def test_an_installed_package_reads_the_recipes_inside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wheel's layout (lightning_pgc/recipes/) comes first; with neither folder the error names both."""
    from lightning_pgc import recipe_files

    inside, beside = tmp_path / "site" / "lightning_pgc" / "recipes", tmp_path / "site" / "recipes"
    (inside / "strategies").mkdir(parents=True)
    (inside / "digits_cnn.yaml").write_text("# inside\n")
    (inside / "strategies" / "ddp.yaml").write_text("# a fragment\n")
    beside.mkdir()
    (beside / "digits_cnn.yaml").write_text("# beside\n")
    monkeypatch.setattr(recipe_files, "CANDIDATES", (inside, beside))
    assert recipe_files.folder() == inside
    assert recipe_files.available() == ["digits_cnn.yaml", "strategies/ddp.yaml"]
    assert recipe_files.describe("lightning_pgc/recipes/digits_cnn.yaml") == "inside"
    (inside / "digits_cnn.yaml").unlink()
    (inside / "__pycache__").mkdir()  # a leftover folder without recipes is skipped
    assert recipe_files.folder() == beside
    monkeypatch.setattr(recipe_files, "CANDIDATES", (inside / "none", beside / "none"))
    with pytest.raises(FileNotFoundError, match="no recipes found in .*none or .*none"):
        recipe_files.folder()


def test_the_module_map_in_the_design_page_is_generated_from_the_package() -> None:
    """docs/design.md's map is :func:`render`'s output exactly (regenerate: ``python benchmarks/module_map.py``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("module_map", ROOT / "benchmarks" / "module_map.py")
    assert spec is not None and spec.loader is not None
    module_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module_map)
    block = module_map.render()
    assert module_map.current((ROOT / "docs" / "design.md").read_text()) == block
    for tree in (ROOT / "lightning_pgc", ROOT / "benchmarks" / "pgc_lab"):
        every = sorted(p.relative_to(tree) for p in tree.rglob("*.py"))
        assert all(f" {p.name} " in block or f" {p.parent.name}/ " in block for p in every)  # no module left out
    assert "theory_metrics.py" in block and "TheoryMeter: the convergence theory's constants" in block


#: the pure math and decisions: free of Lightning, of torch.distributed and of the runtime that uses them
PURE = ("codes", "decisions")
IMPURE = (
    "lightning",
    "torch.distributed",
    "lightning_pgc.runtime",
    "lightning_pgc.strategy",
    "lightning_pgc.callbacks",
)


@pytest.mark.parametrize("package", PURE)
def test_pure_packages_import_no_lightning_and_no_torch_distributed(package: str) -> None:
    files = sorted((ROOT / "lightning_pgc" / package).glob("*.py"))
    assert files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            bad = [n for n in names if any(n == m or n.startswith(m + ".") for m in IMPURE)]
            assert bad == [], f"{path.relative_to(ROOT)} imports {bad}"
