"""The run folder's final products, and their copies as Prefect artifacts."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from jex.fileio import sha256_file, write_json, write_text
from jex.provenance import provenance
from jex.record import Record, write_record
from jex.tasks.documents import CalibrationDoc, FoldDoc, ScoreDoc, read_doc, write_doc
from jex.tasks.keys import stage_key
from jex.tasks.outputs.report import (
    OWN_CLUSTERS,
    MachinesSection,
    RunDocs,
    every_row_own_cluster,
    generation_section,
    prompt_notes,
    reliability_plot,
    render_report,
    skill_plot,
)
from jex.tasks.outputs.samples import write_samples
from jex.tasks.records import CampaignSummaries, FinishedCampaign

if TYPE_CHECKING:
    from jex.tasks.campaign_spec import CampaignSpec

REPORT_MARKER = "_REPORT.json"
"""The report's key and files, written last in a run folder: a later run with the same key renders nothing."""
RUN_FILES = ("predictions.parquet", "samples.parquet", "score.json", "fold.json", "provenance.json", "skill.png",
             "reliability.png", "report.md")


class ReportMarker(Record):
    """`REPORT_MARKER`: the key of the report the run folder holds, and the files it wrote."""

    key: str
    files: list[str]


def report_key(run_dir: Path, summaries: CampaignSummaries, spec: CampaignSpec) -> str:
    """The report's cache key: the key and artifact sha256 of every stage summary it renders, the campaign's
    spec and the speculative proof beside it, if any. Not the timings nor the machines: those describe the
    run that rendered it (each run's own timings are in `stages.json`); nor where the run is logged (`mlflow`)."""
    proof = run_dir / "spec_proof.json"
    return stage_key("report", {"stages": {k: [v.key, v.sha256] for k, v in summaries.done().items()},
                                "spec": spec.model_dump(mode="json", exclude={"mlflow"}),
                                "spec_proof": sha256_file(proof) if proof.exists() else None})


def rendered(run_dir: Path, key: str) -> bool:
    """The run folder holds the report of `key` and every file it wrote (then nothing is rendered again)."""
    marker = run_dir / REPORT_MARKER
    if not marker.exists() or ReportMarker.model_validate_json(marker.read_bytes()).key != key:
        return False
    return all((run_dir / name).exists() for name in RUN_FILES)


def mark_rendered(run_dir: Path, key: str) -> None:
    write_record(run_dir / REPORT_MARKER, ReportMarker(key=key, files=list(RUN_FILES)))


def write_run_folder(run_dir: Path, summaries: CampaignSummaries, spec: CampaignSpec, timings: dict[str, float],
                     machines: MachinesSection | None = None) -> str:
    """predictions.parquet, samples.parquet, score.json, fold.json, report.md, plots and provenance.json.
    `spec`: the campaign (`campaign.json`); `machines`: its machines section, if any."""
    s = summaries.finished()
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(s.score.predictions or s.overlay.predictions, run_dir / "predictions.parquet")
    write_samples(run_dir, s, spec, prompts=spec.samples_prompts)
    docs = run_docs(summaries)
    generated = {"generate": s.generate.sha256} if s.generate is not None else {}
    prov = provenance(inputs={"bundle": s.bundle.sha256, "fast_pass": s.fast_pass.sha256,
                              "reason": s.reason.sha256, **generated, "predictions": s.overlay.sha256},
                      settings=spec.model_dump(mode="json"), engine=s.fast_pass.engine.model_dump(mode="json"),
                      stages={k: {"key": v.key, "folder": v.folder} for k, v in summaries.done().items()},
                      **({"settings_audit": machines.audit} if machines is not None and machines.audit else {}))
    write_doc(run_dir / "score.json", docs.policy.model_copy(update={"provenance": prov}))
    write_doc(run_dir / "fold.json", docs.fold)
    write_json(run_dir / "provenance.json", prov)
    skill_plot(docs.baseline, docs.policy, run_dir / "skill.png")
    reliability_plot(docs.calibration, run_dir / "reliability.png")
    from jex.tasks.bundle.reading import scored_suite

    report = render_report(spec.name, docs, s, timings, machines, notes=_score_notes(run_dir, s, spec),
                           score_spec=scored_suite(s.bundle).spec)
    from jex.tasks.capture.spec_proof import proof_section, read_proof

    if (doc := read_proof(run_dir)) is not None:  # a speculative profile: its exactness proof on this run
        report += "\n" + "\n".join(proof_section(doc.proof(), fell_back=doc.fell_back))
    write_text(run_dir / "report.md", report)
    return report


def _score_notes(run_dir: Path, s: FinishedCampaign, spec: CampaignSpec) -> list[str]:
    """The report's lines after the score: what verbatim catalogs read, and whether every row is its own
    bootstrap cluster."""
    from jex.tasks.bundle.reading import scored_suite

    verbatim = [c.id for c in scored_suite(s.bundle).spec.catalogs if c.prompt_format == "verbatim"]
    samples = pl.read_parquet(run_dir / "samples.parquet")
    own = every_row_own_cluster(samples.select("catalog", "question_id", "scored"))
    generated = generation_section(samples, s.generate) if s.generate is not None else []
    return prompt_notes(spec.engine.render.chat_template, verbatim) + (OWN_CLUSTERS if own else []) \
        + generated


def run_docs(summaries: CampaignSummaries) -> RunDocs:
    """The documents the score, fold and calibrate stages of a finished campaign wrote."""
    s = summaries.finished()
    return RunDocs(policy=read_doc(ScoreDoc, s.score.score_json), baseline=read_doc(ScoreDoc, s.score.baseline_json),
                   fold=read_doc(FoldDoc, s.fold.fold_json),
                   calibration=read_doc(CalibrationDoc, s.calibrate.calibration_json))
