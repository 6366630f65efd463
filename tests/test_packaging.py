"""The wheel: it builds from this tree, carries the recipes, the license and py.typed, declares only lightning and
torch as core dependencies, installs into a fresh virtual environment and runs a packaged recipe from an unrelated
directory through its console script.

Nothing is downloaded: the wheel is built without build isolation (this environment's setuptools) and installed
with ``--no-deps`` into a venv that sees this environment's third-party packages through a ``.pth`` line, so the
only ``lightning_pgc`` it can import is the wheel's.
"""

from __future__ import annotations

import email
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, timeout: float = 240) -> str:
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", "PYTHONPATH"):
        env.pop(key, None)
    proc = subprocess.run(
        args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-6000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # build from a copy of the sources, so no stale build/ folder of the checkout can leak into the wheel
    src = tmp_path_factory.mktemp("src") / "lightning_pgc"
    ignore = shutil.ignore_patterns(
        ".venv", ".git", "build", "dist", "outputs", "*.egg-info", "__pycache__", "wandb", "lightning_logs"
    )
    shutil.copytree(ROOT, src, ignore=ignore)
    dist = tmp_path_factory.mktemp("dist")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(dist),
            str(src),
        ],
        cwd=dist,
    )
    (path,) = dist.glob("lightning_pgc-*.whl")
    return path


def test_wheel_contents_and_metadata(wheel: Path) -> None:
    import lightning_pgc
    from lightning_pgc import recipe_files as recipes

    names = zipfile.ZipFile(wheel).namelist()
    for recipe in recipes.available():
        assert f"lightning_pgc/recipes/{recipe}" in names
    assert "lightning_pgc/py.typed" in names
    assert "lightning_pgc/strategy/strategy.py" in names and "lightning_pgc/emulator/advise.py" in names
    assert not any("pgc_lab" in n or n.startswith("lightning_pgc/experiments/") for n in names)  # the lab stays out
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/")) for n in names)
    dist_info = f"lightning_pgc-{lightning_pgc.__version__}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in names
    meta = email.message_from_bytes(zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA"))
    assert meta["Version"] == lightning_pgc.__version__  # the one version source
    assert meta["License-Expression"] == "Apache-2.0"
    core = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert sorted(r.split(">")[0].split("<")[0].split("=")[0].strip() for r in core) == ["lightning", "torch"]
    assert {"examples", "wandb", "bench", "test"} <= set(meta.get_all("Provides-Extra"))


def test_wheel_holds_every_package_and_the_top_level_recipes(wheel: Path) -> None:
    """The wheel lists its packages explicitly (the top-level recipes/ folder is mapped into it): a package added to
    lightning_pgc/ without being listed in pyproject.toml would be missing from the wheel."""
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "lightning_pgc").rglob("__init__.py"))
    assert packages and all(f"{package}/__init__.py" in names for package in packages), packages
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "lightning_pgc").rglob("*.py"))
    assert [m for m in modules if m not in names] == []
    recipes = sorted(p.relative_to(ROOT / "recipes").as_posix() for p in (ROOT / "recipes").rglob("*.yaml"))
    assert "digits_cnn.yaml" in recipes
    assert [r for r in recipes if f"lightning_pgc/recipes/{r}" not in names] == []


def test_wheel_installs_and_runs_a_packaged_recipe_from_any_directory(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "--quiet", str(wheel)],
        cwd=tmp_path,
    )
    # this environment's third-party packages (torch, lightning, ...), appended after the venv's own site-packages
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp_path).strip()
    (Path(purelib) / "outer_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run([str(py), "-c", "import lightning_pgc; print(lightning_pgc.__file__)"], cwd=work).strip()
    assert Path(where).is_relative_to(venv), where  # the wheel, not this checkout
    script = venv / "bin" / "lightning-pgc"
    assert _run([str(script), "--version"], cwd=work).startswith("lightning-pgc ")
    out = _run(
        [
            str(script),
            "fit",
            "--config",
            "digits_cnn.yaml",
            "--trainer.devices=2",
            "--trainer.max_steps=3",
            "--trainer.enable_progress_bar=false",
        ],
        cwd=work,
    )
    assert "`max_steps=3` reached" in out
    assert list((work / "outputs" / "digits" / "digits_cnn").glob("version_0/checkpoints/*.ckpt"))
