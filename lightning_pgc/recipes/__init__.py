"""The YAML recipes shipped inside the package (``lightning-pgc recipes`` lists them).

A recipe is a plain ``LightningCLI`` config file. Full recipes (``digits_cnn.yaml``, ``cifar10_resnet18.yaml``)
configure model, data and trainer; fragments (``strategies/*.yaml``, ``stragglers/*.yaml``, ``wandb.yaml``)
replace one part and are passed as a later ``--config``. ``lightning-pgc`` resolves ``--config NAME`` to a local
file when one exists at that path, else to the packaged recipe of that name, so an installed wheel runs the
recipes from any directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Optional

__all__ = ["available", "describe", "folder", "resolve"]

#: Prefix accepted in front of a recipe name (the repository layout before the recipes became package data).
LEGACY_PREFIXES = ("recipes/", "lightning_pgc/recipes/")


def folder() -> Path:
    """The folder holding the packaged recipes (inside the installed package)."""
    # the package is installed as files (wheel or editable); no zip-import support is needed
    return Path(str(resources.files(__name__)))


def available() -> list[str]:
    """Names of the packaged recipes, relative to the recipe folder (``digits_cnn.yaml``, ``strategies/ddp.yaml``)."""
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
