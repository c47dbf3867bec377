"""What a finished run folder tells an experiment tracker (MLflow, Weights & Biases): its parameters, metrics,
tags and files, read through the run folder's records. One declaration for both exporters, so a metric is named
and valued alike in each.

Metrics (every number of `score.json`, each interval as its bounds):
    full, full/ci_low, full/ci_high, full_raw
    leg/<leg>/index, leg/<leg>/ci_low, leg/<leg>/ci_high, leg/<leg>/raw
    catalog/<id>/skill, catalog/<id>/ci_low, catalog/<id>/ci_high (the skill's interval), catalog/<id>/acc,
    .../value, .../chance, .../weight, .../n, .../correct, .../unsupported, .../abstained, .../acc_norm (where
    scored)
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

from pydantic import Field, JsonValue

from jex.engine_spec import EMBEDDED_MODEL
from jex.errors import InputError
from jex.provenance import ProvenanceDoc, read_provenance
from jex.record import Record
from jex.run_records import CAMPAIGN_FILE, RecordedCampaign, RunStages
from jex.tasks.documents import ScoreDoc, read_doc

RUN_TAG = "jex.run"
"""The tag naming the jex run (its folder's name, `<campaign>-<identity>`): a tracker's one run per jex run is
found again by it."""
ARTIFACTS = ("report.md", "skill.png", "reliability.png", "samples.parquet", "score.json", "provenance.json")
"""The run folder's files logged with the run (those the folder holds)."""
PLOTS = ("skill.png", "reliability.png")
MAX_PARAM_CHARS = 6000  # MLflow's longest parameter value; a longer one (a template) is logged as its sha256
NOT_AUDITED = "not audited"


class TrackedRun(Record):
    """A finished jex run as a tracker's run: what is logged, whichever tracker."""

    run: str = Field(description="The jex run: its folder's name (the campaign's name and identity)")
    run_dir: str
    params: dict[str, str] = Field(description="Model identity, bundle key, engine settings, coverage, commit")
    metrics: dict[str, float] = Field(description="Every number of score.json (module docstring)")
    tags: dict[str, str] = Field(description="The run, its batch-invariance verdict, where the engine ran, the "
                                             "model's source")
    artifacts: list[str] = Field(description="Files of the run folder logged with it (`ARTIFACTS`)")

    def file(self, name: str) -> Path:
        return Path(self.run_dir) / name


def tracked_run(run_dir: str | Path) -> TrackedRun:
    """A finished run folder (score.json, campaign.json, provenance.json, stages.json) as a tracker's run."""
    run_dir = Path(run_dir).absolute()
    for name in ("score.json", CAMPAIGN_FILE, "provenance.json"):
        if not (run_dir / name).is_file():
            raise InputError(f"not a finished run folder (no {name}): give the folder `jex run` printed last",
                             file=str(run_dir))
    score = read_doc(ScoreDoc, run_dir / "score.json")
    spec = RecordedCampaign.read(run_dir)
    prov = read_provenance(run_dir / "provenance.json")
    stages = RunStages.read(run_dir).root
    return TrackedRun(run=run_dir.name, run_dir=str(run_dir),
                      params=_params(spec, prov, bundle=stages["bundle"].key if "bundle" in stages else None,
                                     draws=score.bootstrap.draws, seed=score.bootstrap.seed),
                      metrics=score_metrics(score), tags=_tags(run_dir.name, spec, prov),
                      artifacts=[n for n in ARTIFACTS if (run_dir / n).is_file()])


def score_metrics(score: ScoreDoc) -> dict[str, float]:
    """Every number of a score document, named as the module docstring says."""
    out = {"full": score.full, "full/ci_low": score.ci[0], "full/ci_high": score.ci[1], "full_raw": score.full_raw}
    for name, leg in score.legs.items():
        key = f"leg/{metric_name(name)}"
        out |= {f"{key}/index": leg.index, f"{key}/ci_low": leg.ci[0], f"{key}/ci_high": leg.ci[1],
                f"{key}/raw": leg.raw}
    for name, c in score.catalogs.items():
        key = f"catalog/{metric_name(name)}"
        out |= {f"{key}/skill": c.skill, f"{key}/ci_low": c.ci[0], f"{key}/ci_high": c.ci[1], f"{key}/acc": c.acc,
                f"{key}/value": c.value, f"{key}/chance": c.chance, f"{key}/weight": c.weight, f"{key}/n": c.n,
                f"{key}/correct": c.correct, f"{key}/unsupported": c.unsupported, f"{key}/abstained": c.abstained}
        if c.acc_norm is not None:
            out[f"{key}/acc_norm"] = c.acc_norm
    return {k: float(v) for k, v in out.items()}


def metric_name(name: str) -> str:
    """A leg or catalog id as a metric name's part: MLflow takes letters, digits, `_-. /` only."""
    return re.sub(r"[^\w.\- ]", "_", name)


def _params(spec: RecordedCampaign, prov: ProvenanceDoc, *, bundle: str | None, draws: int, seed: int
            ) -> dict[str, str]:
    engine = prov.engine
    params: dict[str, JsonValue] = {
        "model": spec.engine.model or EMBEDDED_MODEL,
        "model.weights_sha256": engine.weights_sha256 if engine else None,
        "model.revision": engine.hub.commit if engine and engine.hub else None,
        "bundle": bundle, "bundle.sha256": prov.inputs.get("bundle"), "coverage": spec.coverage,
        "reason_max_tokens": spec.reason_max_tokens, "bootstrap.draws": draws, "bootstrap.seed": seed,
        "jex.version": prov.jex.version, "jex.commit": prov.jex.commit, "jex.dirty": prov.jex.dirty,
        **dict(_flat("engine", spec.engine.model_dump(mode="json", exclude={"cache_dir", "model"})))}
    return {k: _param_text(v) for k, v in params.items() if v is not None}


def _flat(prefix: str, doc: dict[str, JsonValue]) -> Iterator[tuple[str, JsonValue]]:
    for k, v in doc.items():
        if isinstance(v, dict):
            yield from _flat(f"{prefix}.{k}", v)
        else:
            yield f"{prefix}.{k}", v


def _param_text(value: JsonValue) -> str:
    text = value if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) <= MAX_PARAM_CHARS else "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _tags(run: str, spec: RecordedCampaign, prov: ProvenanceDoc) -> dict[str, str]:
    """The run's name, its settings audit's verdict (proven, unproven, failed; `NOT_AUDITED` when no audit covered
    it), where its engine stages ran (the provider: inprocess and local on this host), the engine and the model's
    source (embedded, hub or local), and whether the model was served (whose batch invariance nothing proves)."""
    from jex.tasks.capture.served import NOT_PROVEN

    source = "embedded" if spec.engine.model is None else "hub" if prov.engine and prov.engine.hub else "local"
    served = spec.engine.is_served()
    verdict = NOT_PROVEN if served else prov.settings_audit.status if prov.settings_audit else NOT_AUDITED
    return {RUN_TAG: run, "jex.batch_invariance": verdict, "jex.served": str(served).lower(),
            "jex.provider": spec.machines.provider,
            "jex.where": "local" if spec.machines.provider in ("inprocess", "local") else "machines",
            "jex.engine": spec.engine.kind, "jex.model_source": source}
