"""Secrets: systemd credentials (scheduler/secrets.py) and passwords never logged.

The log tests configure logging the way services do (JSON and console), log through
structlog and through a standard-library logger the way asyncpg/aio-pika do, and check
the rendered lines; the connection-error tests provoke real errors from asyncpg,
aio-pika and aetcd against a closed local port with a password in the URL.
"""

from __future__ import annotations

import io
import logging
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scheduler import broker, db
from scheduler.cli import main as cli_main
from scheduler.config import load_settings
from scheduler.errors import ConfigError, ServiceUnavailable
from scheduler.log import configure_logging, get_logger, scrub
from scheduler.secrets import read_credentials
from tests.support.election import SingleKey

PASSWORDS = ("s3cr3t-pg", "s3cr3t-mq", "s3cr3t-etcd", "pa/ss@word")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def capture_logs() -> Iterator[Callable[[str], io.StringIO]]:
    """Configure logging as services do, writing into a buffer instead of stderr."""

    def configure(fmt: str) -> io.StringIO:
        configure_logging("info", fmt)
        buffer = io.StringIO()
        handler = logging.getLogger().handlers[0]
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(buffer)
        return buffer

    yield configure
    configure_logging("warning", "console")  # what tests/conftest.py set up


def assert_clean(text: str) -> None:
    for secret in PASSWORDS:
        assert secret not in text, f"{secret!r} leaked into: {text[:500]}"


# -- credentials -----------------------------------------------------------------------


def test_credentials_override_the_environment(tmp_path: Path) -> None:
    (tmp_path / "database_url").write_text("postgresql://app:s3cr3t-pg@db.internal/duetime\n")
    (tmp_path / "etcd_password").write_text("s3cr3t-etcd")
    env = {
        "CREDENTIALS_DIRECTORY": str(tmp_path),
        "DUETIME_DATABASE_URL": "postgresql://other@h/x",
        "DUETIME_ETCD_USERNAME": "duetime",
    }
    settings = load_settings(env=env)
    assert settings.database_url == "postgresql://app:s3cr3t-pg@db.internal/duetime"
    assert settings.etcd_password == "s3cr3t-etcd"
    assert settings.etcd_username == "duetime"
    assert settings.amqp_url == "amqp://guest:guest@127.0.0.1:5672/"  # untouched
    assert_clean(repr(settings))
    assert_clean(str(settings.redacted()))
    # flags still win over credentials
    flagged = load_settings(env=env, overrides={"database_url": "postgresql://flag@h/db"})
    assert flagged.database_url == "postgresql://flag@h/db"


def test_no_credentials_directory_means_nothing_read() -> None:
    assert read_credentials({}) == {}
    assert read_credentials({"CREDENTIALS_DIRECTORY": ""}) == {}


@pytest.mark.parametrize(
    ("content", "problem"),
    [(b"\n", "is empty"), (b"\xff\xfe", "not UTF-8"), (b"x" * 70_000, "larger than")],
)
def test_unusable_credential_is_a_config_error(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    (tmp_path / "amqp_url").write_bytes(content)
    with pytest.raises(ConfigError, match=problem) as info:
        load_settings(env={"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert "credential amqp_url" in str(info.value)


def test_invalid_credential_url_is_reported_redacted(tmp_path: Path) -> None:
    (tmp_path / "amqp_url").write_text("http://mq:s3cr3t-mq@h/")
    with pytest.raises(ConfigError) as info:
        load_settings(env={"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert "credential amqp_url" in str(info.value) and "scheme must be" in str(info.value)
    assert_clean(str(info.value))


def test_unreadable_credential_names_the_file_not_the_content(tmp_path: Path) -> None:
    (tmp_path / "etcd_password").mkdir()  # exists, is not a file: ignored
    assert read_credentials({"CREDENTIALS_DIRECTORY": str(tmp_path)}) == {}


# -- scrubbing -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "postgresql://app:s3cr3t-pg@db:5432/duetime",
        "amqps://u:s3cr3t-mq@mq/vh?cafile=/x",
        "postgresql://u:pa/ss@word@db/x",  # unescaped '/' and '@' in the password
        "host=db user=app password=s3cr3t-pg dbname=duetime",
        "postgresql://app@db/duetime?password=s3cr3t-pg&sslmode=require",
        '{"etcd_password": "s3cr3t-etcd"}',
        "Settings(etcd_password='s3cr3t-etcd')",
    ],
)
def test_scrub_removes_passwords(text: str) -> None:
    assert_clean(scrub(text))


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_log_lines_and_tracebacks_are_scrubbed(
    fmt: str, capture_logs: Callable[[str], io.StringIO]
) -> None:
    captured = capture_logs(fmt)
    log = get_logger("duetime.test")
    try:
        raise ConnectionError("cannot reach amqp://duetime:s3cr3t-mq@mq:5672/ (refused)")
    except ConnectionError as exc:
        log.exception(
            "connect_failed",
            dsn="postgresql://app:s3cr3t-pg@db/duetime",
            error=exc,
            etcd_password="s3cr3t-etcd",
            settings={"database_url": "postgresql://a:pa/ss@word@h/d", "password": "s3cr3t-pg"},
        )
    # a library logging through the standard library, with a traceback
    logging.getLogger("aiormq.connection").error(
        "connection to %s failed",
        "amqp://duetime:s3cr3t-mq@mq/",
        exc_info=OSError("postgresql://app:s3cr3t-pg@db/x"),
    )
    output = captured.getvalue()
    assert "connect_failed" in output and "Traceback" in output
    assert "connection to amqp://duetime:***@mq/ failed" in output
    assert_clean(output)


async def test_real_connection_errors_are_scrubbed(
    capture_logs: Callable[[str], io.StringIO],
) -> None:
    captured = capture_logs("json")
    port = closed_port()
    log = get_logger("duetime.test")
    errors: list[BaseException] = []
    with pytest.raises(ServiceUnavailable) as pg:
        await db.connect(f"postgresql://app:s3cr3t-pg@127.0.0.1:{port}/duetime", timeout=2)
    errors.append(pg.value)
    with pytest.raises(ServiceUnavailable) as mq:
        await broker.connect(f"amqp://duetime:s3cr3t-mq@127.0.0.1:{port}/", timeout=2)
    errors.append(mq.value)
    election = SingleKey(
        [f"127.0.0.1:{port}"], "secrets-test", "n1", ttl=2.0, call_timeout=1.0,
        username="root", password="s3cr3t-etcd",
    )  # fmt: skip
    try:
        with pytest.raises(ServiceUnavailable) as etcd:
            await election.current_leader()
        errors.append(etcd.value)
    finally:
        await election.close()
    for exc in errors:
        assert_clean(str(exc))
        log.error("service_down", error=exc, exc_info=exc)
    assert_clean(captured.getvalue())


def test_cli_error_line_is_scrubbed(capsys: pytest.CaptureFixture[str]) -> None:
    port = closed_port()
    code = cli_main(["status", "--database-url", f"postgresql://u:pa/ss@word@127.0.0.1:{port}/x"])
    assert code != 0
    out = capsys.readouterr()
    assert "error" in out.err
    assert_clean(out.out + out.err)


# Ordinary sentences that use the words (errors, handler messages, docs links) pass
# unchanged; the scrubber once turned "Secret: the job ran" into "Secret: *** job ran".
ORDINARY = [
    "Secret: the job ran fine",
    "token: expired after 5 s",
    "the task failed: password: too short",
    "keep secret: nothing",
    "pwd: /home/app",
    "KeyError: 'token'",
    "Error: tokens: 3 used",
    "ValueError: secret sauce missing",
    "the Bearer scheme is used",
    "see http://example.com:8080/docs@v2 for details",
    "failed at https://api.example.com:443/v1/users/@me",
    "GET http://localhost:8089/jobs?status=dead",
    "no secrets at http://host/path",
]


@pytest.mark.parametrize("text", ORDINARY)
def test_scrub_leaves_ordinary_sentences_unchanged(text: str) -> None:
    assert scrub(text) == text


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("postgresql://app:s3cr3t-pg@db:5432/duetime", "s3cr3t-pg"),
        ("redis://:hunter2@cache:6379/0", "hunter2"),
        ("postgresql://u:1234/x@db/x", "1234/x"),  # digits and "/" after a bare user
        ("retry with token=abc123", "abc123"),
        ("host=db password=s3cr3t-pg", "s3cr3t-pg"),
        ('{"password": "hunter2"}', "hunter2"),
        ("{'secret': 'letters'}", "letters"),  # a quoted value counts even if a word
        ("api_token: abcdef", "abcdef"),  # a compound key counts even with a word
        ("password: hunter2", "hunter2"),  # not a plain word
        ("Authorization: Bearer eyJhbGciOi.J9x2", "eyJhbGciOi.J9x2"),
    ],
)
def test_scrub_redacts_credentials(text: str, secret: str) -> None:
    out = scrub(text)
    assert secret not in out and "***" in out, out
