"""Secrets from systemd credentials (``LoadCredential=``), an alternative to env files.

systemd copies each credential into a private, read-only directory that only the
service can read (``$CREDENTIALS_DIRECTORY``, on a non-swappable ramfs where
available), and never puts it in the process environment, where any process of the
same user can read it through ``/proc/<pid>/environ`` and where it is inherited by
every child. A unit says::

    LoadCredential=database_url:/etc/duetime/credentials/database_url

and duetime reads ``$CREDENTIALS_DIRECTORY/database_url``. A credential overrides the
``DUETIME_*`` variable of the same setting (and the TOML file); a command-line flag
still overrides both. Only the settings below can come from credentials: they are the
ones that carry passwords.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from scheduler.errors import ConfigError

__all__ = ["CREDENTIAL_SETTINGS", "MAX_CREDENTIAL_BYTES", "read_credentials"]

#: credential file name → Settings field it sets
CREDENTIAL_SETTINGS: dict[str, str] = {
    "database_url": "database_url",
    "amqp_url": "amqp_url",
    "etcd_username": "etcd_username",
    "etcd_password": "etcd_password",
    "dashboard_token": "dashboard_token",
}
MAX_CREDENTIAL_BYTES = 64 * 1024


def read_credentials(env: Mapping[str, str] | None = None) -> dict[str, tuple[str, str]]:
    """``{setting: (value, source)}`` for every credential file present.

    ``source`` names the credential, never its content. A credential that exists but
    cannot be used (unreadable, empty, too large, not UTF-8) is a ``ConfigError``: the
    operator asked for it, so silently falling back to the environment would hide a
    mistake.
    """
    env = os.environ if env is None else env
    directory = env.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return {}
    found: dict[str, tuple[str, str]] = {}
    for name, setting in CREDENTIAL_SETTINGS.items():
        path = Path(directory) / name
        source = f"credential {name}"
        try:
            if not path.is_file():
                continue
            if path.stat().st_size > MAX_CREDENTIAL_BYTES:
                raise ConfigError(f"{source} is larger than {MAX_CREDENTIAL_BYTES} bytes")
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"{source} cannot be read: {exc.strerror or type(exc).__name__}"
            ) from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{source} is not UTF-8 text") from None
        # editors and `echo` leave a trailing newline; a secret never ends in one
        value = text.rstrip("\r\n")
        if not value.strip():
            raise ConfigError(f"{source} is empty")
        found[setting] = (value, source)
    return found
