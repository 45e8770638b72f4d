"""The settings-to-config step of every duty, and its validation, defined once.

Each duty has a small frozen config dataclass (``DispatcherConfig``, ...): one field per
knob, with a docstring, a default, where ``Settings`` supplies it and what values it
accepts, all declared by ``knob()``::

    batch_size: int = knob(500, setting="claim_batch_size", ge=1)
    publish_timeout: float = knob(DEFAULT_PUBLISH_TIMEOUT, setting=publish_timeout_for, gt=0)

``config_from_settings(DispatcherConfig, settings, **overrides)`` fills the fields that
name a setting (an attribute of ``Settings``, or a function of it) and takes the rest
from their defaults or ``overrides``; ``check_knobs(self)`` in ``__post_init__`` checks
every bound, so a config built by hand (tests, benchmarks) is validated the same way.
Checks between fields (``ddl_timeout >= lock_timeout``) stay in the config that has them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from scheduler.config import Settings

C = TypeVar("C")
T = TypeVar("T")

#: Where a knob's value comes from: a ``Settings`` attribute, or a function of them.
Source = str | Callable[["Settings"], Any] | None


def knob(
    default: T, *, setting: Source = None, gt: float | None = None, ge: float | None = None
) -> T:
    """A config field: its default, its ``Settings`` source, and its bounds (``> gt``,
    ``>= ge``; None, the value of an optional knob, is not checked)."""
    metadata = {"setting": setting, "gt": gt, "ge": ge}
    return dataclasses.field(default=default, metadata=metadata)


def check_knobs(config: object) -> None:
    """Raise ``ValueError`` naming the first field outside its bounds."""
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        gt, ge = f.metadata.get("gt"), f.metadata.get("ge")
        if value is None or (gt is None and ge is None):
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{f.name} must be a number (got {value!r})")
        if gt is not None and not value > gt:
            raise ValueError(f"{f.name} must be > {gt:g} (got {value})")
        if ge is not None and not value >= ge:
            raise ValueError(f"{f.name} must be >= {ge:g} (got {value})")


def config_from_settings(cls: type[C], settings: Settings, **overrides: Any) -> C:
    """``cls`` filled from ``settings`` (the fields that name a setting), then ``overrides``."""
    knobs = dataclasses.fields(cls)  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - {f.name for f in knobs})
    if unknown:
        raise TypeError(f"{cls.__name__} has no knob {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for f in knobs:
        source = f.metadata.get("setting")
        if source is None or f.name in overrides:
            continue
        values[f.name] = getattr(settings, source) if isinstance(source, str) else source(settings)
    values.update(overrides)
    return cls(**values)
