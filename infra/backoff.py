"""One backoff policy for every retry loop in infra: exponential, capped, with full jitter.

Several supervisors retrying in lockstep (same constants, same start) hammer a flaky endpoint at the
same instants; full jitter (AWS architecture blog, "Exponential Backoff And Jitter", 2015: sleep a
uniform draw in [0, min(cap, base * 2**attempt)]) spreads them out. Callers give either a number of
attempts or a deadline, and the exception types that are worth another try. The policies infra uses
are named below; a caller varies one with `dataclasses.replace` (e.g. more attempts from settings).

    key = retry(lambda: s3.put_file(p, key), MACHINE_CALL, retry_on=(OSError,), what="upload")

`wait_until` is the other kind of loop: poll a condition at a fixed interval until a deadline
(a process group to die, a job to finish within its grace), no error involved.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """How long to keep trying and how far apart."""

    attempts: int | None = 5
    """Give up after this many calls (None: only the deadline limits)."""
    base_s: float = 0.5
    """Upper bound of the first sleep; doubles every attempt."""
    cap_s: float = 10.0
    """Upper bound of any sleep."""
    deadline_s: float | None = None
    """Give up once this many seconds have passed since the first call (None: only attempts limit)."""
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.attempts is None and self.deadline_s is None:
            raise ValueError("a Backoff needs attempts or a deadline, or it retries forever")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")

    def delays(self) -> Iterator[float]:
        """The sleep before attempt 2, 3, ...: uniform in [0, min(cap, base * 2**k)] (full jitter)."""
        k = 0
        while True:
            yield self.rng.uniform(0.0, min(self.cap_s, self.base_s * 2 ** k))
            k += 1


MACHINE_CALL = Backoff(attempts=5, base_s=0.5, cap_s=10.0)
"""A call to a machine or its provider (reach, upload, teardown); `Policy.backoff_s` replaces the base."""
SSH_CONNECT = Backoff(attempts=5, base_s=0.5, cap_s=8.0)
"""Opening an SSH connection; `SSHShell.reconnect_attempts` replaces the attempts."""
SSH_RECONNECT = Backoff(attempts=2, base_s=0.1, cap_s=0.1)
"""A command or copy whose connection dropped: once more, on a fresh connection."""
VERIFY_DOWNLOAD = Backoff(attempts=2, base_s=0.1, cap_s=0.1)
"""A download whose bytes did not match the sha256 the machine recorded: fetched once more."""
WATCHDOG_UPLOAD_BASE_S, WATCHDOG_UPLOAD_CAP_S = 1.0, 30.0
"""The watchdog's upload retries until the machine's hard time to live (`until_deadline`)."""


def until_deadline(left_s: float, *, base_s: float = WATCHDOG_UPLOAD_BASE_S,
                   cap_s: float = WATCHDOG_UPLOAD_CAP_S) -> Backoff:
    """Retry for `left_s` seconds whatever the count, sleeping at most a quarter of the time left."""
    return Backoff(attempts=None, base_s=base_s, cap_s=min(cap_s, max(left_s / 4, 0.5)),
                   deadline_s=max(left_s, 0.001))


def wait_until(condition: Callable[[], bool], *, timeout_s: float, every_s: float) -> bool:
    """Poll `condition` every `every_s` until it holds (True) or `timeout_s` passed (False)."""
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= end:
            return False
        time.sleep(every_s)
    return True


def retry(fn: Callable[[], T], policy: Backoff, *, retry_on: tuple[type[BaseException], ...] = (Exception,),
          what: str = "call", give_up: Callable[[BaseException], bool] | None = None) -> T:
    """Call `fn` until it returns; re-raise the last error when attempts or the deadline run out.

    Errors not in `retry_on`, or for which `give_up(error)` is true, are raised at once.
    """
    t0, attempt = time.monotonic(), 0
    delays = policy.delays()
    while True:
        attempt += 1
        try:
            return fn()
        except retry_on as e:
            if give_up is not None and give_up(e):
                raise
            delay = next(delays)
            out_of_attempts = policy.attempts is not None and attempt >= policy.attempts
            out_of_time = policy.deadline_s is not None and time.monotonic() - t0 + delay > policy.deadline_s
            if out_of_attempts or out_of_time:
                log.warning("%s failed (%s: %s); giving up after %d attempt(s)", what, type(e).__name__, e, attempt)
                raise
            log.warning("%s failed (%s), attempt %d; retrying in %.2fs", what, type(e).__name__, attempt, delay)
            time.sleep(delay)
