"""The machine and software an emulated item ran on, written into its record: a result of the CNN tasks depends on
them (a convolution's float rounding differs between CPU kernels and builds, and training amplifies it), so a
summary says which ones its records came from."""

from __future__ import annotations

import os
import platform
import re
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["NOT_RECORDED", "environment", "environments"]

#: what a record without an ``environment`` (one written before records carried it) is counted as
NOT_RECORDED = "not recorded"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _onednn() -> str:
    found = re.search(r"(?:MKL-DNN|oneDNN) (v[\w.]+)", torch.__config__.show())
    return found.group(1) if found else "none"


def environment() -> dict[str, Any]:
    """This process's machine and software: the CPU's model and the kernels torch dispatches to on it (its CPU
    capability), the cores, Python, torch and its oneDNN."""
    return {
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onednn": _onednn(),
    }


def environments(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct environments of ``records``, each with the number of records from it (``records``), most first;
    records that carry none count under ``{"environment": "not recorded"}``."""
    counts: Counter[tuple[tuple[str, Any], ...]] = Counter(
        tuple(sorted((r.get("environment") or {"environment": NOT_RECORDED}).items())) for r in records
    )
    return [{**dict(key), "records": n} for key, n in counts.most_common()]
