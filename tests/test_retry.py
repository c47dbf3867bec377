"""The one backoff policy of infra: exponential, capped, full jitter; attempts or a deadline."""

from __future__ import annotations

import random
import time

import pytest

from jex.infra.backoff import Backoff, retry, until_deadline, wait_until


def test_delays_are_jittered_within_the_exponential_envelope():
    policy = Backoff(attempts=8, base_s=0.5, cap_s=4.0, rng=random.Random(1))
    delays = [d for d, _ in zip(policy.delays(), range(8), strict=False)]
    bounds = [min(4.0, 0.5 * 2 ** k) for k in range(8)]
    assert all(0 <= d <= b for d, b in zip(delays, bounds, strict=True))
    assert len(set(delays)) == 8  # no two sleeps alike


def test_two_supervisors_do_not_retry_in_lockstep():
    a = Backoff(rng=random.Random(1)).delays()
    b = Backoff(rng=random.Random(2)).delays()
    assert [next(a) for _ in range(4)] != [next(b) for _ in range(4)]


def test_retries_until_success_and_returns_the_value():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("transient")
        return "done"

    assert retry(flaky, Backoff(attempts=5, base_s=0.01), retry_on=(OSError,)) == "done"
    assert len(calls) == 3


def test_gives_up_after_the_attempts_with_the_last_error():
    calls = []

    def broken():
        calls.append(1)
        raise OSError(f"failure {len(calls)}")

    with pytest.raises(OSError, match="failure 3"):
        retry(broken, Backoff(attempts=3, base_s=0.01))
    assert len(calls) == 3


def test_gives_up_at_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(OSError):
        retry(lambda: (_ for _ in ()).throw(OSError("down")), Backoff(attempts=None, base_s=0.05, cap_s=0.05,
                                                                       deadline_s=0.5))
    assert time.monotonic() - t0 < 1.0


def test_errors_not_worth_retrying_are_raised_at_once():
    calls = []

    def bad():
        calls.append(1)
        raise KeyError("a bug, not a transient failure")

    with pytest.raises(KeyError):
        retry(bad, Backoff(attempts=5, base_s=0.01), retry_on=(OSError,))
    assert len(calls) == 1


def test_a_policy_that_would_retry_forever_is_refused():
    with pytest.raises(ValueError, match="retries forever"):
        Backoff(attempts=None, deadline_s=None)


def test_a_deadline_policy_sleeps_at_most_a_quarter_of_the_time_left():
    policy = until_deadline(8.0)
    assert policy.attempts is None and policy.deadline_s == 8.0 and policy.cap_s == 2.0
    assert all(d <= 2.0 for d, _ in zip(policy.delays(), range(20), strict=False))


def test_wait_until_returns_once_the_condition_holds():
    t0 = time.monotonic()
    assert wait_until(lambda: time.monotonic() - t0 > 0.1, timeout_s=5.0, every_s=0.01)
    assert time.monotonic() - t0 < 1.0


def test_wait_until_gives_up_at_its_timeout():
    t0 = time.monotonic()
    assert not wait_until(lambda: False, timeout_s=0.2, every_s=0.05)
    assert 0.2 <= time.monotonic() - t0 < 1.0
