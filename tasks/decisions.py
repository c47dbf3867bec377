"""The decision ledger: one per store (`<store>/ledger.toml`), appended to by experiments (one decision per
decided arm), overlay gates (one per rule tested) and campaigns (one per finished run).

Every entry is a `Decision`: what was decided (kind, subject, status), under which pre-registered test
(`gate_sha256`: the test's settings with the suite's and the model's fingerprints, so the same test on
another model or suite is another decision), on which suite and model, and when it may be reopened: free
text (`reopen_when`) and typed conditions (`ReopenIf`) that `reopened` evaluates against what the ledger
itself knows (the models and coverages of every later entry). The file is TOML, one `[[decisions]]`
table per entry, only ever appended to (rewritten atomically under a lock, its old bytes kept as they
were). `jex ledger` lists, filters and shows the reopen conditions that have come true.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import math
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field

from jex.engine_spec import EngineSpec
from jex.errors import InputError
from jex.fileio import atomic_path, toml_tables_text
from jex.record import Record

LEDGER_NAME = "ledger.toml"
DecisionKind = Literal["experiment-arm", "overlay-rule", "campaign"]


def ledger_path(store: str | Path) -> Path:
    """The store's decision ledger."""
    return Path(store) / LEDGER_NAME


class ReopenIf(Record):
    """Typed reopen conditions; a decision is reopened when any set one holds for a later ledger entry."""

    model_params_at_least: float | None = Field(None, gt=0, description="A model of this many parameters or more "
                                                                         "was run (e.g. 1e9)")
    coverage_above: float | None = Field(None, ge=0, le=1, description="A campaign ran with a coverage above this")
    other_suite: bool = Field(False, description="A decision of the same kind was taken on another suite")

    def holds(self, decision: Decision, later: Sequence[Decision]) -> list[str]:
        """The conditions that hold, each as a sentence naming the entry that made it true."""
        out = []
        if self.model_params_at_least is not None:
            big = next((d for d in later if (d.model_params or 0) >= self.model_params_at_least), None)
            if big is not None:
                out.append(f"model_params_at_least {self.model_params_at_least:g}: {big.model_name or big.model} "
                           f"({big.model_params:.3g} parameters, {big.kind} {big.subject}, {big.date})")
        if self.coverage_above is not None:
            wide = next((d for d in later if d.coverage is not None and d.coverage > self.coverage_above), None)
            if wide is not None:
                out.append(f"coverage_above {self.coverage_above:g}: {wide.kind} {wide.subject} ran at coverage "
                           f"{wide.coverage:g} ({wide.date})")
        if self.other_suite and decision.suite_sha256:
            other = next((d for d in later if d.kind == decision.kind and d.suite_sha256
                          and d.suite_sha256 != decision.suite_sha256), None)
            if other is not None:
                out.append(f"other_suite: {other.kind} {other.subject} on suite {str(other.suite_sha256)[:12]} "
                           f"({other.date})")
        return out


class Decision(Record):
    """One `[[decisions]]` entry of the ledger."""

    kind: DecisionKind
    subject: str = Field(description="The arm, the rule id, or the campaign's run folder name")
    status: str = Field(description="GO | NO-GO (arms), PASS | FAIL (overlay rules), DONE (campaigns)")
    source: str = Field(description="The folder the decision was taken in (experiment, gate output, run folder)")
    date: str
    experiment: str | None = None
    gate_sha256: str | None = Field(None, description="The pre-registered test, with the suite's and the model's "
                                                      "fingerprints")
    settings_sha256: str | None = Field(None, description="The test's settings file alone (gate-settings.json)")
    suite_sha256: str | None = None
    model: str | None = Field(None, description="The model's weights sha256")
    model_name: str | None = None
    model_params: float | None = None
    coverage: float | None = None
    metric: str | None = None
    effect: float | None = None
    ci: list[float] | None = None
    p: float | None = None
    placebo: str | None = None
    placebo_effect: float | None = None
    vs_placebo_ci: list[float] | None = None
    rule_sha256: str | None = Field(None, description="An overlay rule's record, hashed (`rule_sha256`)")
    capture_sha256: str | None = Field(None, description="The fast-pass capture the rule was tested on")
    index: float | None = Field(None, description="A campaign's full index")
    hypothesis: str | None = None
    reopen_when: str = "not given"
    reopen_if: ReopenIf | None = None

    def identity(self) -> tuple[str, str, str]:
        """What makes two entries the same decision: a decision already in the ledger is not appended again."""
        return self.kind, self.subject, self.gate_sha256 or self.source


def model_facts(engine: EngineSpec) -> tuple[str, float | None]:
    """The engine's model as the ledger names it, and its parameter count (None when its weights do not say)."""
    from jex.engine.models import parameter_count, resolve_model

    try:
        if engine.is_served():  # its weights are the server's
            return engine.model_name(), None
        params = parameter_count(resolve_model(engine.model, Path(engine.cache_dir)).path)
    except Exception:  # noqa: BLE001 - a count the ledger can do without (e.g. a model only the machines have)
        params = None
    return engine.model_name(), params


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _entry(d: Decision) -> dict[str, object]:
    """The decision as its `[[decisions]]` table: unset fields and a value that is not a finite number (a
    campaign's NaN index) left out. Dumped as Python values: JSON mode would turn a NaN into None."""
    doc = d.model_dump(exclude_none=True)
    if d.reopen_if is not None:
        doc["reopen_if"] = d.reopen_if.model_dump(exclude_defaults=True)
    return {k: v for k, v in doc.items() if not (isinstance(v, float) and not math.isfinite(v))}


def read_decisions(path: str | Path) -> list[Decision]:
    """The ledger's decisions, oldest first (none when the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8")).get("decisions", [])
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"not valid TOML: {e}", file=str(path)) from None
    return [Decision.model_validate(d) for d in raw]


def append_decisions(path: str | Path, decisions: Iterable[Decision]) -> list[Decision]:
    """Append the decisions not already in the ledger (`Decision.identity`); returns those appended. The
    file's old bytes are kept as they were: the new text is written after them, atomically, under a lock."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        seen = {d.identity() for d in read_decisions(path)}
        new = []
        for d in decisions:
            if d.identity() not in seen:
                seen.add(d.identity())
                new.append(d)
        if new:
            lead = "\n" if old and not old.endswith("\n\n") else ""
            with atomic_path(path) as tmp:
                tmp.write_text(old + lead + toml_tables_text("decisions", [_entry(d) for d in new]), encoding="utf-8")
    return new


def reopened(decisions: Sequence[Decision]) -> list[tuple[Decision, list[str]]]:
    """Each decision with typed reopen conditions that have come true, and why (later entries only)."""
    out = []
    for i, d in enumerate(decisions):
        if d.reopen_if is not None and (why := d.reopen_if.holds(d, decisions[i + 1:])):
            out.append((d, why))
    return out


def ungated_rules(decisions: Sequence[Decision], rules: Sequence[tuple[str, str]], *, suite_sha256: str,
                  capture_sha256: str | None = None) -> list[str]:
    """The rules (id, `OverlayRuleBase.sha256()`) with no passed gate record of their hash on this suite
    (and, when given, this fast-pass capture), each as a sentence saying what the ledger holds instead."""
    missing = []
    for rule_id, sha in rules:
        records = [d for d in decisions if d.kind == "overlay-rule" and d.rule_sha256 == sha]
        ok = [d for d in records if d.status == "PASS" and d.suite_sha256 == suite_sha256
              and (capture_sha256 is None or d.capture_sha256 == capture_sha256)]
        if ok:
            continue
        if not records:
            why = "no gate record of this rule (its kind and parameters)"
        elif not any(d.status == "PASS" for d in records):
            why = f"its gate record(s) say {sorted({d.status for d in records})}"
        elif capture_sha256 is None or not any(d.suite_sha256 == suite_sha256 for d in records):
            why = "it passed on another suite"
        else:
            why = "it passed on another capture of this suite (another engine or render)"
        missing.append(f"rule {rule_id!r}: {why}")
    return missing


def format_decisions(decisions: Sequence[Decision]) -> str:
    """One line per decision: date, kind, subject, status, effect and CI, test hash, model, reopen-when."""
    lines = [f"{'date':<21} {'kind':<15} {'subject':<26} {'status':<6} {'effect':>8}  {'95% CI':<20} test   "
             "model        reopen when"]
    for d in decisions:
        ci = f"[{d.ci[0]:+.3f}, {d.ci[1]:+.3f}]" if d.ci else "-"
        effect = f"{d.effect:+.3f}" if d.effect is not None else (f"{d.index:.3f}" if d.index is not None else "-")
        lines.append(f"{d.date:<21} {d.kind:<15} {d.subject:<26} {d.status:<6} {effect:>8}  {ci:<20} "
                     f"{(d.gate_sha256 or '-')[:6]:<6} {(d.model_name or d.model or '-')[:12]:<12} {d.reopen_when}")
    return "\n".join(lines)


__all__ = ["LEDGER_NAME", "Decision", "ReopenIf", "append_decisions", "format_decisions", "ledger_path", "model_facts",
           "now", "read_decisions", "reopened", "ungated_rules"]
