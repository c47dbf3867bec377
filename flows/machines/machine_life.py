"""One machine's life as a Prefect task run (`machine_life`, `machine-LABEL`): the steps the fleet hands
it (bootstrap, golden replay, each engine job with its collection), each a child task run `LABEL-STEP`,
and always its teardown; and what the fleet reads of a started machine (its provider record, its
`provenance.json`, its GPU models)."""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import cast

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture

from jex.errors import InfraError, JexError
from jex.infra.machine import MachineSession
from jex.infra.providers import Machine
from jex.infra.records import MachineProvenance


class _Order:
    """One step a machine's life is asked to take: `work`, or (`work` None) the end of its life."""

    def __init__(self, step: str, work: Callable[[], object] | None, reason: str = ""):
        self.step, self.work, self.reason = step, work, reason
        self.done: Future[None] = Future()


class MachineLife:
    """The hand-over between the fleet and one machine's life task run: the steps it is to take, in
    order, and how its teardown went. A plain object on purpose: Prefect passes it to the task run as
    is (it rebuilds dataclasses and pydantic models, which would lose what the run writes here)."""

    def __init__(self, session: MachineSession):
        self.session = session
        self.run: PrefectFuture[None] | None = None
        self.teardown_error: str | None = None
        self._orders: queue.Queue[_Order] = queue.Queue()
        self._ended = ""
        """Why the life ended (empty while it runs): later steps fail at once, naming it."""
        self._lock = threading.Lock()

    def order(self, step: str, work: Callable[[], object]) -> Future[None]:
        """Ask the life to take a step next; the future ends as the step does."""
        order = _Order(step, work)
        with self._lock:
            if self._ended:
                order.done.set_exception(InfraError(f"machine {self.session.label}: no {step} step, its life "
                                                    f"ended ({self._ended})"))
            else:
                self._orders.put(order)
        return order.done

    def close(self, reason: str) -> None:
        """End the life after its steps so far: teardown with `reason`."""
        with self._lock:
            if not self._ended:
                self._orders.put(_Order("close", None, reason))

    def run_ended(self, run: object) -> None:
        """The life's task run ended (its future's callback): a run that could not begin (Prefect failed to
        create it) took none of its steps, which would otherwise wait for it forever."""
        self.end("its task run ended")

    def next(self) -> _Order:
        return self._orders.get()

    def end(self, reason: str) -> None:
        """The life ends: steps still waiting, and any asked for later, fail naming `reason` (the first one)."""
        with self._lock:
            self._ended = self._ended or reason
            reason = self._ended
            while not self._orders.empty():
                order = self._orders.get_nowait()
                if order.work is not None:
                    order.done.set_exception(InfraError(f"machine {self.session.label}: no {order.step} step, "
                                                        f"its life ended ({reason})"))


@task(name="machine-step", task_run_name="{label}-{step}", cache_policy=NO_CACHE, persist_result=False,
      log_prints=True)
def machine_step(label: str, step: str, work: Callable[[], object]) -> None:
    """One step of machine `label`'s life (bootstrap, golden, an engine job and its collection, teardown),
    a child task run of `machine-LABEL`."""
    work()


@task(name="machine", task_run_name="machine-{label}", cache_policy=NO_CACHE, persist_result=False,
      log_prints=True)
def machine_life(label: str, life: MachineLife) -> None:
    """A machine's whole life: the steps the fleet hands it, in order, until it is closed or a step fails
    (the step's error goes to the fleet and fails this run); the teardown step always runs. Not retried:
    the session already retries what can be retried, and the campaign decides about a failed machine."""
    reason = "fleet closed"
    try:
        while (order := life.next()).work is not None:
            try:
                machine_step(label=label, step=order.step, work=order.work)
            except BaseException as e:
                order.done.set_exception(e)
                reason = failure_reason(e)
                raise
            order.done.set_result(None)
        reason = order.reason
    finally:
        life.end(reason)
        try:
            machine_step(label=label, step="teardown", work=partial(life.session.teardown, reason))
        except JexError as e:
            life.teardown_error = str(e)
            raise


def failure_reason(e: BaseException) -> str:
    """A teardown reason naming a failure."""
    return f"{type(e).__name__}: {str(e)[:160]}"


def machine_of(session: MachineSession) -> Machine:
    """The session's machine, there once `start` has run (as for every session a fleet uses)."""
    return cast(Machine, session.machine)


def machine_provenance(session: MachineSession) -> MachineProvenance | None:
    """The machine's `provenance.json` as its bootstrap left it (None before one was collected)."""
    return MachineProvenance.model_validate_json(session.provenance_file.read_text()) \
        if session.provenance_file else None


def machine_gpus(machine: MachineProvenance | None) -> list[str]:
    """The machine's GPU models, sorted (from `nvidia-smi -L` in its provenance; [] on a CPU machine)."""
    return sorted(re.findall(r"GPU \d+: ([^(;]+?) \(", machine.gpus if machine else ""))
