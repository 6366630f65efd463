"""Where the YAML recipes are, and how ``--config NAME`` resolves to one (``lightning-pgc recipes`` lists them).

The recipes live in ``recipes/`` at the top of the repository; the wheel ships that folder inside the package as
``lightning_pgc/recipes/`` (pyproject.toml maps it), so an installed package finds them beside its modules and a
source checkout finds them beside the package. A recipe is a plain ``LightningCLI`` config file. Full recipes (``digits_cnn.yaml``, ``cifar10_resnet18.yaml``)
configure model, data and trainer; fragments (``strategies/*.yaml``, ``stragglers/*.yaml``, ``wandb.yaml``)
replace one part and are passed as a later ``--config``. ``lightning-pgc`` resolves ``--config NAME`` to a local
file when one exists at that path, else to the packaged recipe of that name, so an installed wheel runs the
recipes from any directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

__all__ = ["available", "describe", "folder", "resolve"]

#: Prefixes accepted in front of a recipe name: the repository's folder, and the package's in an installed wheel.
LEGACY_PREFIXES = ("recipes/", "lightning_pgc/recipes/")

_PACKAGE = Path(__file__).resolve().parent
#: Where the recipes can be, in order: inside the installed package (a wheel), beside the package (a checkout).
CANDIDATES = (_PACKAGE / "recipes", _PACKAGE.parent / "recipes")


def folder() -> Path:
    """The folder holding the recipes: the first of :data:`CANDIDATES` that holds any (``*.yaml`` at its top)."""
    for candidate in CANDIDATES:
        if any(candidate.glob("*.yaml")):
            return candidate
    raise FileNotFoundError(
        f"no recipes found in {' or '.join(str(c) for c in CANDIDATES)}: the package is installed without its "
        "recipes folder (reinstall it from a wheel or a full checkout)"
    )


def available() -> list[str]:
    """Names of the recipes, relative to the recipe folder (``digits_cnn.yaml``, ``strategies/ddp.yaml``)."""
    root = folder()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.yaml"))


def resolve(name: str) -> Optional[Path]:
    """The packaged recipe called ``name`` (a name from :func:`available`, optionally prefixed ``recipes/``),
    or ``None`` when there is none."""
    clean = name.replace("\\", "/")
    for prefix in LEGACY_PREFIXES:
        if clean.startswith(prefix):
            clean = clean[len(prefix) :]
            break
    return folder() / clean if clean in available() else None


def describe(name: str) -> str:
    """First comment line of a packaged recipe (its one-line summary), without the ``#``."""
    path = resolve(name)
    if path is None:
        raise KeyError(f"no packaged recipe {name!r}; packaged: {', '.join(available())}")
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return ""
