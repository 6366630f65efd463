"""The package's layout as a user meets it: what ``import lightning_pgc`` loads, and where the public names live."""

from __future__ import annotations

import ast
import graphlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

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
    for name in ("Stall", "Freeze", "Kill", "Terminate", "NaNGradient", "NaNBuffers"):
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


def _package_modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / "lightning_pgc").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (function-level imports included), with
    the packages above them."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            found |= {".".join(parts[:k]) for k in range(1, len(parts) + 1)} & set(modules)
    return found - {name}


def test_every_module_of_the_package_is_reachable_from_what_a_user_runs() -> None:
    """The wheel holds what a user imports or runs: every module under lightning_pgc/ is imported, directly or not,
    by the package's ``__init__``, its ``__main__``, the console script or a class path a recipe names (the lab
    lives in benchmarks/pgc_lab, outside the wheel)."""
    modules = _package_modules()
    pyproject = (ROOT / "pyproject.toml").read_text()
    entries = {"lightning_pgc", "lightning_pgc.__main__"}
    entries |= {m.rpartition(":")[0] for m in re.findall(r'=\s*"(lightning_pgc[\w.]*:\w+)"', pyproject)}
    for recipe in (ROOT / "recipes").rglob("*.yaml"):
        for value in re.findall(
            r"^\s*(?:class_path|-)?\s*:?\s*(lightning_pgc(?:\.\w+)+)\s*$", recipe.read_text(), re.M
        ):
            parts = value.split(".")
            entries |= {".".join(parts[:k]) for k in range(1, len(parts) + 1)} & set(modules)
    seen: set[str] = set()
    todo = [e for e in entries if e in modules]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_imported(name, modules[name], modules))
    assert sorted(set(modules) - seen) == []
    assert "lightning_pgc.emulator.advise" in seen  # the walk follows the CLI's function-level imports


def test_the_package_runs_with_only_lightning_and_torch() -> None:
    """With Lightning and torch imported (their own optional probes run as usual), every other optional package and
    the lab are made unimportable; ``import lightning_pgc`` and ``Trainer(strategy="pgc")`` still work."""
    code = """
import sys
import lightning.pytorch as pl, torch
BLOCKED = {"jsonargparse", "sklearn", "torchvision", "wandb", "matplotlib", "rich", "pgc_lab"}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
for name in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
    del sys.modules[name]
sys.meta_path.insert(0, Block())
import lightning_pgc, lightning_pgc.callbacks
trainer = pl.Trainer(strategy="pgc", devices=2, accelerator="cpu", logger=False, enable_progress_bar=False)
print(type(trainer.strategy).__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "PGCStrategy"


def test_no_two_classes_of_the_package_or_the_lab_share_a_name() -> None:
    """One name per concept: a module-level class of lightning_pgc/ or benchmarks/pgc_lab/ has a name no other
    module-level class there has, so a reader (and an import) never confuses two of them."""
    where: dict[str, list[str]] = {}
    for tree in (ROOT / "lightning_pgc", ROOT / "benchmarks" / "pgc_lab"):
        for path in sorted(tree.rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert len(where) > 50  # the walk sees the classes
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def _import_edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that running ``name`` runs by its imports: every import statement in its source, at
    module level, under ``if TYPE_CHECKING:`` and inside functions alike. An import of ``a.b.c`` also runs the
    packages ``a`` and ``a.b`` (their ``__init__``), except those above ``name`` itself (already running when it
    runs); ``from a.b import c`` runs ``a.b.c`` too when that is a module."""
    is_package = path.name == "__init__.py"
    base = name if is_package else name.rpartition(".")[0]
    above = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
    found: set[str] = set()

    def runs(target: str) -> None:
        parts = target.split(".")
        found.update(p for p in (".".join(parts[:k]) for k in range(1, len(parts))) if p in modules and p not in above)
        while target and target not in modules:  # `import a.b.name`: the module that defines `name`
            target = target.rpartition(".")[0]
        if target:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                runs(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                package = base.split(".")[: len(base.split(".")) - node.level + 1]
                source = ".".join(package + ([source] if source else []))
            if source.split(".")[0] != "lightning_pgc":
                continue
            runs(source)
            found.update(f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in modules)
    return found - {name}


def _import_cycle(modules: dict[str, Path]) -> Optional[list[str]]:
    """One import cycle among ``modules`` (its modules in import order, the first again at the end), or None."""
    graph = {name: _import_edges(name, path, modules) for name, path in modules.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:
        return list(reversed(err.args[1]))
    return None


def test_the_package_has_no_import_cycle() -> None:
    """No module of the package imports, directly or not, a module that imports it back. Every import statement
    counts, wherever it stands: a cycle hidden in a function, or under ``if TYPE_CHECKING:`` (an annotation that
    names its caller's class), is a missing interface all the same. A part that needs its owner's attributes says
    which in a ``Protocol`` of its own (e.g. :class:`~lightning_pgc.strategy.leadership.LeadershipHost`)."""
    cycle = _import_cycle(_package_modules())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_the_cycle_check_sees_cycles_through_type_checking_and_function_level_imports(tmp_path: Path) -> None:
    """A cycle through an ``if TYPE_CHECKING:`` import, one through a function-level import and one through a
    package's ``__init__`` are each found (so the check above cannot pass by missing them)."""
    sources = {
        "owner.py": "from pkg.part import Part\n",
        "part.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.owner import Owner\n",
        "late.py": "def f():\n    from pkg import sub\n",
        "sub/__init__.py": "from pkg.sub.leaf import X\n",
        "sub/leaf.py": "from pkg.late import f\n",
    }
    modules = {}
    for rel, text in sources.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace("pkg", "lightning_pgc"))
        parts = rel.removesuffix(".py").removesuffix("/__init__").split("/")
        modules[".".join(["lightning_pgc", *parts])] = path
    cycle = _import_cycle(modules)
    assert cycle is not None and cycle[0] == cycle[-1]
    found = set(cycle)
    assert found in (
        {"lightning_pgc.owner", "lightning_pgc.part"},
        {"lightning_pgc.late", "lightning_pgc.sub", "lightning_pgc.sub.leaf"},
    )
    without_type_checking = {m: p for m, p in modules.items() if m != "lightning_pgc.part"}
    assert set(_import_cycle(without_type_checking) or ()) == {
        "lightning_pgc.late",
        "lightning_pgc.sub",
        "lightning_pgc.sub.leaf",
    }
    (tmp_path / "late.py").write_text("def f():\n    pass\n")
    assert _import_cycle(without_type_checking) is None
