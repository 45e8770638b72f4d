"""Configuration: one validated ``Settings`` object from defaults, a TOML file,
the environment and command-line flags (in increasing precedence, DESIGN §7).

Why a hand-rolled schema instead of a settings library: every field needs three
spellings (TOML key, ``DUETIME_*`` variable, ``--flag``), redaction of secrets, and
errors that teach ("unknown key 'lease_tl' in duetime.toml; did you mean
'lease_ttl'?"). The table in ``settings`` is the single source for all three; a bad value
produces exactly one line naming the source it came from, and *all* bad values are
reported together so an operator fixes a file in one pass.

Three modules, in the order a value goes through them: ``parsers`` (a raw value to a
typed one, or the reason it is refused), ``settings`` (``Settings`` and the ``FIELDS``
table that names each field's parser, help text and secrecy), ``loading``
(``load_settings``: the sources in order of precedence and the checks across fields).
Import from here: ``from scheduler.config import Settings, load_settings``.
"""

from scheduler.config.loading import ENV_PREFIX, env_name, load_settings
from scheduler.config.parsers import redact_url
from scheduler.config.settings import (
    DEFAULT_DB_TIMEOUT,
    FIELDS,
    MIN_RETENTION_DAYS,
    Field,
    Settings,
)

__all__ = [
    "DEFAULT_DB_TIMEOUT",
    "ENV_PREFIX",
    "FIELDS",
    "MIN_RETENTION_DAYS",
    "Field",
    "Settings",
    "env_name",
    "load_settings",
    "redact_url",
]
