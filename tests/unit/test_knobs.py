"""The one settings-to-config step of the duties, and its validation."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.config import Settings
from scheduler.duties.dispatcher import DispatcherConfig
from scheduler.duties.knobs import config_from_settings
from scheduler.duties.maintainer import MaintainerConfig
from scheduler.duties.planner import PlannerConfig
from scheduler.duties.reconciler import ReconcilerConfig
from scheduler.publisher import publish_timeout_for


def test_each_duty_config_takes_its_settings_and_keeps_its_other_defaults() -> None:
    settings = dataclasses.replace(
        Settings(),
        claim_batch_size=123,
        probe_interval=0.07,
        visibility_timeout=42.0,
        reconcile_interval=3.0,
        max_republishes=4,
        planner_horizon=20.0,
        poll_interval=2.0,
        partition_days_ahead=5,
        retention_days=3.0,
    )
    dispatcher = config_from_settings(DispatcherConfig, settings)
    assert (dispatcher.batch_size, dispatcher.probe_interval) == (123, 0.07)
    assert dispatcher.publish_timeout == publish_timeout_for(settings)
    assert dispatcher.ready_timeout == DispatcherConfig().ready_timeout
    reconciler = config_from_settings(ReconcilerConfig, settings)
    assert (reconciler.visibility_timeout, reconciler.interval) == (42.0, 3.0)
    assert (reconciler.max_republishes, reconciler.batch_size) == (4, 123)
    planner = config_from_settings(PlannerConfig, settings)
    assert (planner.horizon, planner.poll_interval) == (20.0, 2.0)
    assert planner.batch_size == PlannerConfig().batch_size  # not the claim batch size
    maintainer = config_from_settings(MaintainerConfig, settings)
    assert (maintainer.days_ahead, maintainer.retention_days) == (5, 3.0)


def test_overrides_win_over_settings() -> None:
    config = config_from_settings(DispatcherConfig, Settings(), batch_size=7, ready_timeout=2.0)
    assert (config.batch_size, config.ready_timeout) == (7, 2.0)


def test_an_unknown_override_is_refused() -> None:
    with pytest.raises(TypeError, match="no knob batch_sise"):
        config_from_settings(DispatcherConfig, Settings(), batch_sise=7)


@pytest.mark.parametrize(
    ("config", "values", "message"),
    [
        (DispatcherConfig, {"batch_size": 0}, "batch_size must be >= 1"),
        (DispatcherConfig, {"probe_interval": 0}, "probe_interval must be > 0"),
        (ReconcilerConfig, {"max_republishes": True}, "max_republishes must be a number"),
        (PlannerConfig, {"max_fires_per_batch": 0}, "max_fires_per_batch must be >= 1"),
        (MaintainerConfig, {"days_ahead": -1}, "days_ahead must be >= 0"),
    ],
)
def test_bounds_are_checked_whichever_way_the_config_is_built(
    config: type, values: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        config(**values)
    with pytest.raises(ValueError, match=message):
        config_from_settings(config, Settings(), **values)
