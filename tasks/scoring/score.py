"""The score stage: both scorers, the clustered bootstrap, and `score.json` + `score.md`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from jex.errors import JexError
from jex.fileio import sha256_file, write_text
from jex.provenance import provenance
from jex.tasks.bundle.suite_table import ScoreSpec, load_predictions, load_suite_table
from jex.tasks.documents import BootstrapParams, CatalogResult, LegScore, ScoreDoc, write_doc
from jex.tasks.scoring.bootstrap_ci import DEFAULT_DRAWS, DEFAULT_SEED, bootstrap_ci
from jex.tasks.scoring.index import Score, catalog_chances, catalog_shares, score_predictions, scored_frame
from jex.tasks.scoring.plain import plain_score


class ScorerDisagreement(JexError):
    """The vectorised and the plain scorer differ: a bug in one of them; no report is written."""


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only in one scorer" for k in set(a) ^ set(b)]
        for k in sorted(set(a) & set(b)):
            out += _differences(a[k], b[k], f"{path}/{k}")
        return out
    same = a == b and type(a) is type(b) if not isinstance(a, float) else (
        isinstance(b, float) and a.hex() == b.hex())
    return [] if same else [f"{path}: {a!r} != {b!r}"]


def score_twice(rows: pl.DataFrame, predictions: pl.DataFrame, spec: ScoreSpec) -> Score:
    """Score with both implementations; raise `ScorerDisagreement` unless they agree bit for bit."""
    fast = score_predictions(rows, predictions, spec)
    ids = predictions["run_id"].to_list()

    def by_run(column: str) -> dict[str, Any] | None:
        if column not in predictions.columns or (column == "probs" and not spec.needs_probs):
            return None
        return dict(zip(ids, predictions[column].to_list(), strict=True))

    plain = plain_score(rows.to_dicts(), by_run("choice") or {}, spec.legs,
                        [{"id": c.id, "leg": c.leg, "weight": c.weight, "chance": c.chance,
                          "exclusions": c.exclusions, "scoring": c.scoring, "secondary": c.secondary,
                          "readout": c.readout}
                         for c in spec.catalogs], probs=by_run("probs"), abstain=by_run("abstain"),
                        acc_norm=by_run("acc_norm_choice"), true_mass=by_run("true_mass"),
                        exact_match=by_run("exact_match"), pass_at_k=by_run("pass_at_k"))
    diffs = _differences(fast.to_json(), plain)
    if diffs:
        raise ScorerDisagreement("the two scorers disagree: " + "; ".join(diffs[:5]))
    return fast


def score_with_ci(rows: pl.DataFrame, predictions: pl.DataFrame, spec: ScoreSpec, *,
                  draws: int = DEFAULT_DRAWS, seed: int = DEFAULT_SEED) -> ScoreDoc:
    """The scoring contract's document (without provenance)."""
    score = score_twice(rows, predictions, spec)
    frame = scored_frame(rows, predictions, spec)
    ci = bootstrap_ci(frame, spec, catalog_chances(frame, spec), draws=draws, seed=seed)
    return ScoreDoc(full=score.full, full_raw=score.full_raw,
                    legs={leg: LegScore(index=v["index"], raw=v["raw"], ci=ci["legs"][leg])
                          for leg, v in score.legs.items()},
                    catalogs={cid: CatalogResult(**vars(v), ci=ci["catalogs"][cid])
                              for cid, v in score.catalogs.items()},
                    ci=ci["full"], bootstrap=BootstrapParams(draws=draws, seed=seed))


def render_markdown(doc: ScoreDoc, title: str = "Score") -> str:
    lo, hi = doc.ci
    lines = [f"# {title}", "", f"**Full index: {doc.full:.2f}** (95% CI {lo:.2f} to {hi:.2f}; "
             f"raw {doc.full_raw:.2f}); {doc.bootstrap.draws} clustered draws, "
             f"seed {doc.bootstrap.seed}.", "", "| leg | index | 95% CI | raw |", "|---|---:|---|---:|"]
    for leg, v in doc.legs.items():
        lines.append(f"| {leg} | {v.index:.2f} | {v.ci[0]:.2f} to {v.ci[1]:.2f} | {v.raw:.2f} |")
    return "\n".join(lines + catalog_table(doc)) + "\n"


def catalog_table(doc: ScoreDoc) -> list[str]:
    """Per catalog: its scoring kind, the kind's value and chance level, skill and its interval."""
    lines = ["", "| catalog | leg | scoring | n | correct | unsupported | abstained | acc | value | chance | skill | "
             "95% CI | weight |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for cid, v in doc.catalogs.items():
        lines.append(f"| {cid} | {v.leg} | {v.kind} | {v.n} | {v.correct} | {v.unsupported} | "
                     f"{v.abstained} | {v.acc:.4f} | {v.value:.4f} | {v.chance:.4f} | {v.skill:.4f} | "
                     f"{v.ci[0]:.4f} to {v.ci[1]:.4f} | {v.weight:g} |")
    normed = {cid: v for cid, v in doc.catalogs.items() if v.acc_norm is not None}
    if normed:  # lm-eval's two metrics of its loglikelihood catalogs, side by side
        lines += ["", "| catalog (lm-eval metrics) | n | acc | acc_norm |", "|---|---:|---:|---:|"]
        lines += [f"| {cid} | {v.n} | {v.acc:.4f} | {v.acc_norm:.4f} |" for cid, v in normed.items()]
    return lines


def area_table(doc: ScoreDoc, spec: ScoreSpec) -> list[str]:
    """Per area of the manifest (catalogs grouped by `area`): catalogs, rows, the area's share of the
    composite's weight, its index (100 x the share-weighted mean skill) and its points in the full index
    (100 x sum of share x skill; the areas' points sum to `full`). Empty when every catalog is 'general'."""
    areas: dict[str, list[str]] = {}
    for c in spec.catalogs:
        if c.id in doc.catalogs:
            areas.setdefault(c.area, []).append(c.id)
    if set(areas) <= {"general"}:
        return []
    shares = catalog_shares(spec)
    lines = ["", "| area | catalogs | n | share of weight | index | points in full |", "|---|---:|---:|---:|---:|---:|"]
    for area, ids in areas.items():
        share = sum(shares[c] for c in ids)
        points = 100.0 * sum(shares[c] * doc.catalogs[c].skill for c in ids)
        lines.append(f"| {area} | {len(ids)} | {sum(doc.catalogs[c].n for c in ids)} | {share:.4f} | "
                     f"{points / share:.2f} | {points:.2f} |")
    return lines


def score_files(suite: str | Path, predictions: str | Path, out_dir: str | Path, *, draws: int = DEFAULT_DRAWS,
                seed: int = DEFAULT_SEED, settings: dict[str, Any] | None = None) -> ScoreDoc:
    """`jex score`: read, score twice, bootstrap, write `score.json` and `score.md` atomically."""
    table = load_suite_table(suite)
    preds = load_predictions(predictions, table.rows)
    doc = score_with_ci(table.rows, preds, table.spec, draws=draws, seed=seed).model_copy(update={
        "provenance": provenance(inputs={**table.sha256, "predictions": sha256_file(predictions)},
                                 settings=settings or {})})
    out = Path(out_dir)
    write_doc(out / "score.json", doc)
    write_text(out / "score.md", render_markdown(doc))
    return doc
