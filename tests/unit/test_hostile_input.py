"""Hostile input never becomes a traceback.

Property tests: whatever bytes reach a worker, ``scheduler.messages.decode`` returns a
``JobMessage`` or raises ``MalformedMessage`` with a reason, nothing else; whatever an
operator types as a cron expression, time zone, interval, duration, payload or config
file, duetime answers with its own error (``ScheduleSpecError``/``InvalidInput``/
``ConfigError``), never another exception.

``KNOWN_ESCAPES`` are inputs this fuzzing found ``decode`` letting through (or crashing
on) before scheduler/messages.py was fixed; they stay here as regression cases.
"""

from __future__ import annotations

import json
import string
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scheduler.cli._util import parse_duration, parse_payload, parse_when
from scheduler.config import load_settings
from scheduler.cron import parse_cron
from scheduler.errors import ConfigError, InvalidInput
from scheduler.messages import MAX_BODY_BYTES, JobMessage, MalformedMessage, decode
from scheduler.planning import ScheduleSpec

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID: dict[str, Any] = {
    "job_id": 7,
    "due_at": "2026-03-01T12:00:00+00:00",
    "attempt": 1,
    "task": "send_email",
    "payload": {"to": "a@example.com"},
    "idempotency_key": "job:7",
    "epoch": 3,
}

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def decode_or_malformed(body: bytes) -> JobMessage | None:
    """The property: decode returns a message or raises MalformedMessage with a reason."""
    try:
        return decode(body)
    except MalformedMessage as exc:
        assert str(exc), "MalformedMessage without a reason"
        return None


@FUZZ
@given(st.binary(max_size=2048))
@example(b"")
@example(b"\x00" * 10)
@example(b"\xef\xbb\xbf{}")  # BOM
@example(b"[" * 100_000)  # deep nesting: RecursionError inside json
@example(b'{"a":' * 50_000)
@example(b"NaN")
@example(b"1e999999")
def test_decode_random_bytes(body: bytes) -> None:
    decode_or_malformed(body)


@FUZZ
@given(json_values)
def test_decode_random_json(value: Any) -> None:
    decode_or_malformed(json.dumps(value).encode())


@FUZZ
@given(st.sampled_from(sorted(VALID)), json_values)
def test_decode_contract_field_replaced_by_anything(field: str, value: Any) -> None:
    body = dict(VALID, **{field: value})
    msg = decode_or_malformed(json.dumps(body).encode())
    if msg is not None:  # accepted: then it must satisfy the contract's types
        assert isinstance(msg.job_id, int) and msg.job_id >= 1
        assert isinstance(msg.attempt, int) and msg.attempt >= 1
        # task/payload/idempotency_key are optional in a pointer message (None or valid)
        assert msg.task is None or (isinstance(msg.task, str) and msg.task.strip())
        assert msg.payload is None or isinstance(msg.payload, dict)
        assert msg.due_at.tzinfo is not None


@FUZZ
@given(
    st.dictionaries(
        # unknown fields only: "shard" is a field of the contract, validated like the rest
        st.text(max_size=20).filter(lambda name: name != "shard"),
        json_values,
        max_size=5,
    )
)
def test_extra_fields_are_tolerated(extra: dict[str, Any]) -> None:
    body = {**extra, **VALID}
    msg = decode_or_malformed(json.dumps(body).encode())
    assert msg is not None and msg.job_id == 7


@FUZZ
@given(st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=50))
def test_unicode_task_and_payload_round_trip(text: str) -> None:
    body = dict(VALID, task=text, payload={text: text})
    msg = decode_or_malformed(json.dumps(body, ensure_ascii=False).encode())
    if msg is not None:
        assert msg.payload == {text: text}


def test_missing_field_and_huge_body_have_reasons() -> None:
    with pytest.raises(MalformedMessage, match="missing field"):
        decode(json.dumps({k: v for k, v in VALID.items() if k != "epoch"}).encode())
    with pytest.raises(MalformedMessage, match="exceeds"):
        decode(b" " * (MAX_BODY_BYTES + 1))
    deep = {"payload": {"a": None}}
    node = deep["payload"]
    for _ in range(100_000):
        node["a"] = {"a": None}
        node = node["a"]
    with pytest.raises(MalformedMessage, match="not JSON"):
        decode(json.dumps(dict(VALID, **{"x": 1}))[:-1].encode() + b',"deep":' + b"[" * 200_000)


def _with(**fields: Any) -> bytes:
    return json.dumps(dict(VALID, **fields)).encode()


KNOWN_ESCAPES = [
    pytest.param(
        b'{"job_id": ' + b"9" * 5000 + b"}",
        id="int-over-4300-digits",
    ),
    pytest.param(
        _with(job_id=2**63),
        id="job_id-beyond-bigint",
    ),
    pytest.param(
        _with(attempt=2**31),
        id="attempt-beyond-int4",
    ),
    pytest.param(
        _with(idempotency_key="k\x00"),
        id="nul-in-idempotency-key",
    ),
    pytest.param(
        _with(task="\ud800"),
        id="lone-surrogate-task",
    ),
    pytest.param(
        _with(due_at="9999-12-31T23:00:00-14:00"),
        id="due_at-not-representable-in-utc",
    ),
]


@pytest.mark.parametrize("body", KNOWN_ESCAPES)
def test_known_escapes_are_malformed(body: bytes) -> None:
    with pytest.raises(MalformedMessage):
        decode(body)


def test_largest_payload_the_database_accepts_is_a_valid_message() -> None:
    payload = {"a": "\x1f" * (1024 * 1024 - 64)}
    msg = JobMessage(
        7,
        datetime(2026, 1, 1, tzinfo=UTC),
        1,
        1,
        task="t",
        payload=payload,
        idempotency_key="job:7",
    )
    assert decode(msg.encode()).payload == payload


# -- operator input: cron, zones, intervals, durations, payloads, config -------------

cron_alphabet = string.digits + " */,-?LW#@abcdefghijklmnopqrstuvwxyzJANFEBMONSU\t"


@FUZZ
@given(st.text(alphabet=cron_alphabet, max_size=40), st.sampled_from(["UTC", "Europe/Berlin"]))
@example("* * * * * * *", "UTC")
@example("@every 5s", "UTC")
@example("0 0 31 2 *", "UTC")  # never fires
@example("*/0 * * * *", "UTC")
@example("99999999999999999999 * * * *", "UTC")
def test_cron_expressions(expr: str, tz: str) -> None:
    try:
        parse_cron(expr, tz)
    except InvalidInput as exc:  # ScheduleSpecError is one
        assert str(exc)


@FUZZ
@given(st.text(max_size=60))
@example("../../etc/passwd")
@example("Europe/../../../etc/localtime")
@example("\x00")
@example("posixrules")
@example("/usr/share/zoneinfo/UTC")
def test_time_zones(tz: str) -> None:
    try:
        parse_cron("0 3 * * *", tz)
    except InvalidInput as exc:
        assert str(exc)


@FUZZ
@given(st.text(max_size=30))
@example("1e309s")
@example("99999999999999999999d")
@example("-5s")
@example("0s")
def test_intervals_and_durations(text: str) -> None:
    try:
        ScheduleSpec(name="n", task="t", interval=text)
    except InvalidInput as exc:
        assert str(exc)
    try:
        parse_duration(text)
    except InvalidInput as exc:
        assert str(exc)
    try:
        parse_when(text)
    except InvalidInput as exc:
        assert str(exc)


@FUZZ
@given(st.text(max_size=200))
@example('{"a": NaN}')
@example('{"a": "\\u0000"}')
@example('{"a": 1e999}')
def test_cli_payloads(text: str) -> None:
    try:
        parse_payload(text)
    except InvalidInput as exc:
        assert str(exc)


_CLI_FIX = (
    "scheduler/cli/_util.py parse_payload catches only JSONDecodeError: the CLI prints a "
    "traceback. Fix: except (ValueError, RecursionError) -> InvalidInput"
)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("[" * 50_000, id="deep-nesting"),
        pytest.param('{"a": ' + "9" * 5000 + "}", id="int-over-4300-digits"),
    ],
)
def test_cli_payload_known_escapes(text: str) -> None:
    with pytest.raises(InvalidInput):
        parse_payload(text)


toml_values = st.recursive(
    st.none().map(lambda _: '""')
    | st.integers().map(str)
    | st.floats(allow_nan=True).map(lambda f: repr(f).replace("inf", "inf").replace("nan", "nan"))
    | st.text(max_size=20).map(json.dumps)
    | st.booleans().map(lambda b: str(b).lower()),
    lambda inner: st.lists(inner, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
    max_leaves=5,
)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(
            [
                *sorted(VALID),
                "database_url",
                "lease_ttl",
                "etcd_endpoints",
                "metrics_port",
                "log_level",
                "claim_batch_size",
                "lease_safety_margin",
                "etcd_prefix",
                "node_id",
                "amqp_url",
                "bogus",
            ]
        ),
        toml_values,
        max_size=6,
    )
)
def test_config_files(tmp_path_factory: pytest.TempPathFactory, values: dict[str, str]) -> None:
    path = Path(tmp_path_factory.mktemp("cfg")) / "duetime.toml"
    path.write_text("\n".join(f"{k} = {v}" for k, v in values.items()))
    try:
        load_settings(config_file=path, env={})
    except ConfigError as exc:
        assert str(exc)


@FUZZ
@given(st.text(max_size=300))
@example("[duetime]\n[duetime]")
@example("a = [" * 2000)
@example("lease_ttl = 1e400")
def test_config_file_text(tmp_path_factory: pytest.TempPathFactory, data: str) -> None:
    path = Path(tmp_path_factory.mktemp("cfg")) / "duetime.toml"
    path.write_text(data, encoding="utf-8", errors="surrogatepass")
    try:
        load_settings(config_file=path, env={})
    except ConfigError as exc:
        assert str(exc)


def test_config_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "duetime.toml"
    path.write_bytes(b"lease_ttl = \x80")
    with pytest.raises(ConfigError):
        load_settings(config_file=path, env={})


@FUZZ
@given(
    st.sampled_from(
        [
            "DUETIME_LEASE_TTL",
            "DUETIME_METRICS_PORT",
            "DUETIME_ETCD_ENDPOINTS",
            "DUETIME_DATABASE_URL",
            "DUETIME_CLAIM_BATCH_SIZE",
        ]
    ),
    st.text(max_size=40),
)
def test_environment_values(name: str, value: str) -> None:
    try:
        load_settings(env={name: value})
    except ConfigError as exc:
        assert str(exc)


@FUZZ
@given(st.text(min_size=1, max_size=200).filter(lambda t: t.strip() and "\x00" not in t))
@example("é" * 200)  # 400 bytes: failed every publish of its job, forever (fuzz finding)
@example("🙂" * 200)
def test_any_task_name_fits_the_message_properties(task: str) -> None:
    """A task is at most 200 characters (CHECK jobs_task_too_long) but AMQP's ``type``
    property holds 255 bytes; the publisher cuts it, and the body keeps the whole name."""
    from pamqp.header import ContentHeader

    from scheduler.messages import JobMessage, encode_job

    message = JobMessage(1, datetime(2026, 1, 1, tzinfo=UTC), 1, 1, task=task)
    try:
        body, properties = encode_job(message)
    except UnicodeEncodeError:  # a lone surrogate: PostgreSQL text cannot hold one
        return
    ContentHeader(0, len(body), properties).marshal()
    assert task.startswith(properties.message_type or "")
    assert decode(body).task == task
