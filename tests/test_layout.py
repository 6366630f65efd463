"""The package's layout as a user meets it: what ``import lightning_pgc`` loads, and where the public names live."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: research code and tools that ``import lightning_pgc`` (and the CLI) must not load
RESEARCH = (
    "lightning_pgc.theory",
    "lightning_pgc.theory_corrections",
    "lightning_pgc.simulate",
    "lightning_pgc.emulator",
    "lightning_pgc.experiments",
    "lightning_pgc.demo",
)


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
    loaded = _loaded("import " + ", ".join(m for m in RESEARCH if m != "lightning_pgc.demo"))
    assert set(RESEARCH) - {"lightning_pgc.demo"} <= set(loaded)


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
