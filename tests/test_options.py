"""PGCStrategy's option groups: each dataclass checks its own fields, a group is taken as the dataclass or a dict of
its fields (an unknown key refused), what depends on the scheme is checked at construction, and the registered
names carry their groups."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

import lightning_pgc
from lightning_pgc import (
    AutoOptions,
    CodingOptions,
    CoordinatorOptions,
    DiagnosticsOptions,
    LivenessOptions,
    PGCStrategy,
)
from lightning_pgc.strategy import REGISTERED
from lightning_pgc.strategy.options import GROUPS

ROOT = Path(__file__).resolve().parents[1]


def test_the_constructor_stays_small_and_every_group_is_a_parameter() -> None:
    params = inspect.signature(PGCStrategy.__init__).parameters
    assert len(params) - 1 <= 18  # without self
    for name, cls in GROUPS.items():
        assert params[name].default == cls()  # the defaults are the group's own


@pytest.mark.parametrize(
    "cls, fields, error, message",
    [
        (CoordinatorOptions, {"replication": 0}, ValueError, r"coordinator\.replication must be an int >= 1, got 0"),
        (CoordinatorOptions, {"staleness": 0}, ValueError, r"coordinator\.staleness must be an int >= 1, got 0"),
        (CoordinatorOptions, {"fresh": 0}, ValueError, r"coordinator\.fresh must be an int >= 1"),
        (CoordinatorOptions, {"widen_after": -1.0}, ValueError, r"coordinator\.widen_after must be seconds >= 0"),
        (
            CoordinatorOptions,
            {"staleness": 3, "max_staleness": 2},
            ValueError,
            r"coordinator\.max_staleness must be None or >= staleness \(3\), got 2",
        ),
        (CoordinatorOptions, {"choice": "newest"}, ValueError, r"coordinator\.choice must be one of 'round_robin'"),
        (CoordinatorOptions, {"staleness": "3"}, TypeError, r"coordinator\.staleness must be int, got str '3'"),
        (AutoOptions, {"max_stragglers": 0}, ValueError, r"auto\.max_stragglers must be an int >= 1, got 0"),
        (AutoOptions, {"margin": 1.0}, ValueError, r"auto\.margin must be in \[0, 1\), got 1\.0"),
        (AutoOptions, {"threshold": 0}, ValueError, r"auto\.threshold must be a finite number > 0"),
        (AutoOptions, {"threshold": "1"}, TypeError, r"auto\.threshold must be float, got str"),
        (AutoOptions, {"horizon": 0}, ValueError, r"auto\.horizon must be an int >= 1"),
        (AutoOptions, {"horizon": 2.5}, TypeError, r"auto\.horizon must be int, got float 2\.5"),
        (CodingOptions, {"warmup": "lazy"}, ValueError, r"coding\.warmup must be one of 'full', 'gradual'"),
        (CodingOptions, {"staleness_correction": "dc"}, ValueError, r"coding\.staleness_correction must be one of"),
        (
            CodingOptions,
            {"lookahead_steps": 1.0},
            ValueError,
            r"coding\.lookahead_steps must be None, or >= 0 with staleness_correction='lookahead' \(it is 'none'\)",
        ),
        (
            CodingOptions,
            {"staleness_correction": "delay_compensation", "dc_lambda": -0.1},
            ValueError,
            r"coding\.dc_lambda must be None, or >= 0",
        ),
        (CodingOptions, {"max_condition": 0.5}, ValueError, r"coding\.max_condition must be a finite number >= 1"),
        (CodingOptions, {"max_condition": float("inf")}, ValueError, r"coding\.max_condition must be a finite"),
        (LivenessOptions, {"timeout": 0}, ValueError, r"liveness\.timeout must be positive seconds, got 0"),
        (LivenessOptions, {"timeout": "5m"}, TypeError, r"liveness\.timeout must be float, got str '5m'"),
        (LivenessOptions, {"max_lag": 0}, ValueError, r"liveness\.max_lag must be an int >= 1 or None"),
        (LivenessOptions, {"heartbeat_interval": 0.0}, ValueError, r"liveness\.heartbeat_interval must be positive"),
        (LivenessOptions, {"heartbeat_misses": 0}, ValueError, r"liveness\.heartbeat_misses must be an int >= 1"),
        (LivenessOptions, {"failover": 1}, TypeError, r"liveness\.failover must be bool or None, got int 1"),
        (DiagnosticsOptions, {"every_n_steps": 0}, ValueError, r"diagnostics\.every_n_steps must be an int >= 1"),
        (DiagnosticsOptions, {"enabled": 1}, TypeError, r"diagnostics\.enabled must be bool, got int 1"),
    ],
)
def test_each_group_refuses_a_bad_field_naming_it(cls: type, fields: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        cls(**fields)
    scheme = {CoordinatorOptions: "bounded", AutoOptions: "auto"}.get(cls, "pgc_cr")
    with pytest.raises(error, match=message):  # the same check when the group comes as a dict
        PGCStrategy(scheme=scheme, **{cls.group: fields})


def test_a_dict_and_the_dataclass_build_the_same_strategy() -> None:
    as_dicts = PGCStrategy(
        scheme="bounded",
        coordinator={"replication": 3, "staleness": 4, "choice": "oldest", "widen_after": 2.0},
        coding={"staleness_correction": "lookahead", "lookahead_steps": 0.5},
        liveness={"timeout": 10.0, "heartbeat_misses": 30},
        diagnostics={"enabled": False},
    )
    as_classes = PGCStrategy(
        scheme="bounded",
        coordinator=CoordinatorOptions(replication=3, staleness=4, choice="oldest", widen_after=2.0),
        coding=CodingOptions(staleness_correction="lookahead", lookahead_steps=0.5),
        liveness=LivenessOptions(timeout=10.0, heartbeat_misses=30),
        diagnostics=DiagnosticsOptions(enabled=False),
    )
    for name in GROUPS:
        assert getattr(as_dicts, name) == getattr(as_classes, name)
        assert isinstance(getattr(as_dicts, name), GROUPS[name])
    assert repr(as_dicts._make_scheme(6)) == repr(as_classes._make_scheme(6))
    assert as_dicts.coordinator.max_staleness is None and as_dicts.liveness.heartbeat_interval == 0.2  # defaults
    with pytest.raises(Exception):  # frozen: a strategy's options do not change under it
        as_dicts.coordinator.staleness = 2  # type: ignore[misc]


def test_an_unknown_key_or_a_wrong_type_of_group_is_refused() -> None:
    with pytest.raises(ValueError, match=r"PGCStrategy\(coordinator=\.\.\.\): unknown option 'stalenes'; "):
        PGCStrategy(scheme="bounded", coordinator={"stalenes": 3})
    with pytest.raises(ValueError, match=r"unknown option 'heartbeat'; LivenessOptions has timeout, max_lag"):
        PGCStrategy(liveness={"timeout": 5.0, "heartbeat": 0.1})
    with pytest.raises(TypeError, match=r"PGCStrategy\(coding=\.\.\.\) must be a CodingOptions or a dict"):
        PGCStrategy(coding="gradual")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"PGCStrategy\(liveness=\.\.\.\) must be a LivenessOptions"):
        PGCStrategy(liveness=CodingOptions())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument 'staleness'"):
        PGCStrategy(scheme="bounded", staleness=3)  # type: ignore[call-arg]  (the groups' fields are not keywords)


def test_what_depends_on_the_scheme_is_checked_at_construction() -> None:
    with pytest.raises(
        ValueError, match=r"coordinator options apply to scheme='bounded' only .*got coordinator=\{'staleness': 3\}"
    ):
        PGCStrategy(scheme="pgc_cr", coordinator={"staleness": 3})
    with pytest.raises(ValueError, match=r"auto options apply to scheme='auto' only"):
        PGCStrategy(scheme="dgd", stragglers=0, auto={"horizon": 5})
    with pytest.raises(ValueError, match=r"use coding\.warmup='full'"):
        PGCStrategy(scheme="pgc_cr_naive", coding={"warmup": "gradual"})
    with pytest.raises(ValueError, match="there is no staleness to correct"):
        PGCStrategy(scheme="gc_fr", coding={"staleness_correction": "momentum"})
    with pytest.raises(ValueError, match="unknown scheme 'pgc_xx'"):
        PGCStrategy(scheme="pgc_xx")
    with pytest.raises(ValueError, match="nonfinite must be 'skip' or 'raise'"):
        PGCStrategy(nonfinite="ignore")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"PGCStrategy\(stragglers=\.\.\.\) must be"):
        PGCStrategy(stragglers="1")  # type: ignore[arg-type]
    # defaults given explicitly are no options of another scheme
    PGCStrategy(scheme="pgc_cr", coordinator=CoordinatorOptions(), auto={"max_stragglers": 1})


def test_every_registered_name_carries_its_options_to_the_trainer() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning.pytorch as pl

    for name, (description, kwargs) in REGISTERED.items():
        entry = StrategyRegistry[name]
        assert entry["strategy"] is PGCStrategy and entry["init_params"] == kwargs and entry["description"]
        built = pl.Trainer(strategy=name, accelerator="cpu", devices=4, logger=False).strategy
        expected = PGCStrategy(**kwargs)
        assert isinstance(built, PGCStrategy) and built.scheme_name == expected.scheme_name
        for group in GROUPS:
            assert getattr(built, group) == getattr(expected, group), (name, group)
    bounded = pl.Trainer(strategy="bounded_staleness", accelerator="cpu", devices=4, logger=False).strategy
    assert bounded.coordinator == CoordinatorOptions(replication=2, staleness=2)


def test_a_name_registered_with_group_options_builds_them() -> None:
    """A registered name may carry any group (the form the entries of ``REGISTERED`` take)."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning.pytorch as pl

    name = "pgc_test_lookahead"
    StrategyRegistry.register(
        name,
        PGCStrategy,
        description="test",
        scheme="pgc_cr",
        stragglers=1,
        coding={"staleness_correction": "lookahead"},
        liveness={"timeout": 9.0},
    )
    try:
        built = pl.Trainer(strategy=name, accelerator="cpu", devices=4, logger=False).strategy
        assert built.coding.staleness_correction == "lookahead" and built.liveness.timeout == 9.0
    finally:
        StrategyRegistry.remove(name)


def test_the_groups_are_exported_and_their_module_needs_no_lightning() -> None:
    for cls in GROUPS.values():
        assert getattr(lightning_pgc, cls.__name__) is cls and cls.__name__ in lightning_pgc.__all__
    path = ROOT / "lightning_pgc" / "strategy" / "options.py"
    impure = ("lightning", "torch.distributed", "lightning_pgc.runtime", "lightning_pgc.callbacks")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        assert not [n for n in names if any(n == m or n.startswith(m + ".") for m in impure)], names


def test_every_flat_keyword_of_old_records_names_a_field_of_its_group() -> None:
    """The lab reads old records' flat strategy keywords into today's groups: each lands on a field that exists."""
    from dataclasses import fields

    from pgc_lab.experiments.spec import FLAT_KEYWORDS

    for keyword, (group, field) in FLAT_KEYWORDS.items():
        assert field in {f.name for f in fields(GROUPS[group])}, keyword
