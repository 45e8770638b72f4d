"""Failure policy (pure): back-off shape, Retry/Fail semantics, error text."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from workers.retry import (
    DEFAULT_RETRY,
    MAX_ERROR_CHARS,
    Fail,
    GiveUp,
    Retry,
    RetryLater,
    RetryPolicy,
    decide,
    describe,
)


def test_policy_without_jitter_grows_exponentially_and_caps() -> None:
    policy = RetryPolicy(base=2.0, factor=3.0, cap=100.0, jitter=False)
    assert [policy.delay(n) for n in range(1, 7)] == [2.0, 6.0, 18.0, 54.0, 100.0, 100.0]


def test_full_jitter_stays_within_the_ceiling_and_spreads() -> None:
    policy = RetryPolicy(base=1.0, factor=2.0, cap=60.0)
    rng = random.Random(7)
    for failures in range(1, 12):
        ceiling = min(60.0, 2.0 ** (failures - 1))
        samples = [policy.delay(failures, rng=rng) for _ in range(200)]
        assert all(0.0 <= s <= ceiling for s in samples)
        assert max(samples) - min(samples) > ceiling * 0.5  # really spread, not constant


def test_huge_attempt_numbers_do_not_overflow() -> None:
    assert RetryPolicy(jitter=False).delay(1000) == DEFAULT_RETRY.cap


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base": 0}, "base must be > 0"),
        ({"factor": 0.5}, "factor must be >= 1"),
        ({"base": 10, "cap": 5}, "cap (5) must be >= base (10)"),
        ({"base": float("inf")}, "must be finite"),
    ],
)
def test_policy_validation_says_what_is_wrong(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RetryPolicy(**kwargs)


def test_exception_retries_with_policy_delay_until_budget_spent() -> None:
    policy = RetryPolicy(base=10.0, factor=2.0, jitter=False)
    exc = ValueError("boom")
    assert decide(exc, attempt=1, max_attempts=3, policy=policy) == RetryLater(
        10.0, "ValueError: boom"
    )
    assert decide(exc, attempt=2, max_attempts=3, policy=policy) == RetryLater(
        20.0, "ValueError: boom"
    )
    assert decide(exc, attempt=3, max_attempts=3, policy=policy) == GiveUp("ValueError: boom")


def test_retry_uses_the_requested_delay_and_still_counts_an_attempt() -> None:
    assert decide(Retry(in_=7), attempt=1, max_attempts=5) == RetryLater(
        7.0, "Retry: retry requested in 7s"
    )
    assert decide(
        Retry(in_=timedelta(minutes=2), reason="not ready"), attempt=2, max_attempts=5
    ) == RetryLater(120.0, "Retry: not ready")
    assert decide(Retry(in_=7), attempt=5, max_attempts=5) == GiveUp("Retry: retry requested in 7s")


def test_fail_goes_dead_at_once() -> None:
    assert decide(Fail("bad payload"), attempt=1, max_attempts=5) == GiveUp("Fail: bad payload")


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), timedelta(seconds=-5)])
def test_retry_rejects_impossible_delays(bad: object) -> None:
    with pytest.raises(ValueError, match="Retry delay"):
        Retry(in_=bad)  # type: ignore[arg-type]


def test_describe_truncates_and_handles_empty_messages() -> None:
    assert describe(KeyError()) == "KeyError"
    text = describe(RuntimeError("x" * 5000))
    assert len(text) == MAX_ERROR_CHARS
    assert text.startswith("RuntimeError: xxx") and text.endswith("...")


def test_timeout_is_an_ordinary_failure() -> None:
    decision = decide(
        TimeoutError("handler exceeded its timeout of 2s"),
        attempt=1,
        max_attempts=2,
        policy=RetryPolicy(jitter=False),
    )
    assert decision == RetryLater(5.0, "TimeoutError: handler exceeded its timeout of 2s")


# -- bounds: no duration a handler or a policy supplies can overflow the database --------


def test_any_requested_delay_is_bounded() -> None:
    from workers.retry import MAX_RETRY_DELAY

    for seconds in (1e13, 1e300, MAX_RETRY_DELAY * 2):
        decision = decide(Retry(in_=seconds), attempt=1, max_attempts=3)
        assert isinstance(decision, RetryLater) and decision.delay == MAX_RETRY_DELAY
    with pytest.raises(ValueError, match="366 days"):
        RetryPolicy(base=1.0, cap=MAX_RETRY_DELAY + 1)


def test_hostile_exception_texts_become_storable_errors() -> None:
    from workers.retry import MAX_ERROR_CHARS, describe

    class NoText(Exception):
        def __str__(self) -> str:
            raise RuntimeError("nope")

    assert describe(NoText()) == "NoText: <str() raised RuntimeError>"
    text = describe(ValueError("a\x00b\ud800" * 1_000_000))
    assert len(text) <= MAX_ERROR_CHARS * 4 and "\x00" not in text
    text.encode("utf-8")  # no lone surrogate left
