"""``load_settings``: defaults < TOML file < environment < systemd credentials < flags,
every bad value reported at once, one line each naming its source, with a suggestion
for a misspelt key; then the checks that span several fields.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scheduler.config.parsers import redact_url
from scheduler.config.settings import FIELDS, Settings
from scheduler.errors import ConfigError
from scheduler.secrets import read_credentials  # systemd credentials (security)

ENV_PREFIX = "DUETIME_"


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _suggest(key: str, *, env: bool = False) -> str:
    close = difflib.get_close_matches(key, FIELDS, n=1)
    if not close:
        return ""
    return f"; did you mean {env_name(close[0])}?" if env else f"; did you mean {close[0]!r}?"


def _invalid(errors: list[str]) -> ConfigError:
    """One line for one bad value (the CLI prints it after 'duetime: error:'), else a list."""
    if len(errors) == 1:
        return ConfigError(f"invalid configuration: {errors[0]}")
    return ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def _read_toml(path: Path) -> Mapping[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    # Accept either top-level keys or a [duetime] table (beside it, a [shards] table).
    if set(data) - {"shards"} == {"duetime"} and isinstance(data["duetime"], dict):
        data = {**data["duetime"], **{k: v for k, v in data.items() if k == "shards"}}
    return data


def load_settings(
    *,
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build settings: defaults < TOML file < environment < overrides (flags).

    Raises ``ConfigError`` listing every bad value, one per line, each naming its source.
    """
    env = os.environ if env is None else env
    raw: dict[str, tuple[Any, str]] = {}
    errors: list[str] = []

    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        path = Path(path)
        for key, value in _read_toml(path).items():
            if key not in FIELDS:
                errors.append(f"unknown key {key!r} in {path}{_suggest(key)}")
                continue
            raw[key] = (value, f"{path}: {key}")

    known_env = {env_name(n) for n in FIELDS} | {ENV_PREFIX + "CONFIG"}
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX) or key.startswith(ENV_PREFIX + "TEST_"):
            continue
        if key not in known_env:
            name = key[len(ENV_PREFIX) :].lower()
            errors.append(f"unknown environment variable {key}{_suggest(name, env=True)}")
            continue
        if key != ENV_PREFIX + "CONFIG":
            raw[key[len(ENV_PREFIX) :].lower()] = (value, key)

    # -- systemd LoadCredential= (scheduler/secrets.py): credentials override the
    # environment and the TOML file; flags below still override them. ------------------
    raw.update(read_credentials(env))

    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in FIELDS:
            raise ConfigError(f"unknown setting {key!r}{_suggest(key)}")
        raw[key] = (value, "--" + key.replace("_", "-"))

    values: dict[str, Any] = {}
    for key, (value, source) in raw.items():
        spec = FIELDS[key]
        try:
            values[key] = spec.parse(value)
        except ValueError as exc:
            shown = "***" if spec.secret else value
            if key.endswith("_url") and isinstance(value, str):
                shown = redact_url(value)
            errors.append(f"{source}={shown!s}: {key} {exc}")
    if errors:
        raise _invalid(errors)
    settings = Settings(**values)
    tls_files = (settings.etcd_ca_file, settings.etcd_cert_file, settings.etcd_key_file)
    if settings.etcd_ca_file is None and any(tls_files):
        errors.append("etcd_cert_file/etcd_key_file need etcd_ca_file (it turns TLS on)")
    if (settings.etcd_cert_file is None) != (settings.etcd_key_file is None):
        errors.append("etcd_cert_file and etcd_key_file must be set together")
    if errors:
        raise _invalid(errors)
    ttl = settings.lease_ttl
    margin = settings.effective_safety_margin
    if margin >= ttl:
        errors.append(f"lease_safety_margin {margin} must be smaller than lease_ttl {ttl}")
    if settings.effective_statement_timeout > ttl:
        errors.append(
            f"scheduler_statement_timeout {settings.effective_statement_timeout} must be at "
            f"most lease_ttl {ttl} (a frozen leader's statement must end before its "
            "successor needs the fence)"
        )
    if 0 < settings.worker_prefetch < settings.worker_concurrency:
        errors.append(
            f"worker_prefetch {settings.worker_prefetch} must be 0 (automatic) or at least "
            f"worker_concurrency {settings.worker_concurrency} (else fewer handlers run)"
        )
    if settings.fence_takeover_grace >= ttl:
        errors.append(
            f"fence_takeover_grace {settings.fence_takeover_grace} must be smaller than "
            f"lease_ttl {ttl}"
        )
    if errors:
        raise _invalid(errors)
    return settings
