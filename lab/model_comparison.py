"""Many models, one comparison: finished runs of one bundle side by side (`jex compare`, and
`jex run --model A --model B` at its end).

Every run is scored on the same rows and resampled with the same clustered bootstrap draws
(`experiment_stats.shared_draws`, the experiments' machinery): each model's score has its 95%
interval, and each pair's difference its *paired* interval (the draw-by-draw difference of the two
models' statistics) and sign-flip p. Models are ranked only where those intervals separate them: a
model's rank is 1 + the number of models whose paired difference over it excludes zero, so models no
interval separates share a rank. Read from the run folders alone (their predictions and the bundle
their stages name); nothing is recomputed by an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations
from pathlib import Path

from pydantic import Field

from jex.engine_spec import SERVED_PREFIX
from jex.errors import InputError
from jex.fileio import sha256_json, write_json, write_text
from jex.provenance import ProvenanceBlock, provenance
from jex.record import Record
from jex.run_records import RunStages

COMPARE_JSON, COMPARE_MD, COMPARE_PLOT = "compare.json", "compare.md", "compare.png"


class Interval(Record):
    """A point value with its 95% interval (index points; a catalog's: its skill x 100)."""

    value: float
    ci: tuple[float, float]

    def separated(self) -> bool:
        """The interval excludes zero (for a difference: the two sides differ)."""
        return self.ci[0] > 0 or self.ci[1] < 0


class ModelScore(Record):
    """One model's run: its scores with their intervals, under the comparison's draws."""

    label: str = Field(description="The model's name in this comparison (its name, or the run folder's when "
                                   "two runs name the same model)")
    model: str = Field(description="The model as its campaign named it ('embedded' for the embedded one)")
    run_dir: str
    full: Interval
    legs: dict[str, Interval]
    catalogs: dict[str, Interval] = Field(description="Each catalog's skill x 100 (chance-corrected)")
    acc: dict[str, float] = Field(description="Each catalog's accuracy")
    rank: int = Field(description="1 + the models whose paired difference over this one excludes zero")


class PairDifference(Record):
    """`b` minus `a` on the same rows, paired draw by draw."""

    a: str
    b: str
    full: Interval
    legs: dict[str, Interval]
    catalogs: dict[str, Interval]
    p: float = Field(description="Two-sided sign-flip permutation p of the full-index difference")

    def separated(self) -> bool:
        return self.full.separated()


class Comparison(Record):
    """`compare.json`: the models of one bundle, each pair's paired difference, and how they were drawn."""

    bundle: str = Field(description="The bundle key every run read")
    rows: int
    draws: int
    seed: int
    permutations: int
    models: list[ModelScore] = Field(description="In the order given")
    pairs: list[PairDifference] = Field(description="Every pair (a before b in the order given): b - a")
    provenance: ProvenanceBlock

    def leaderboard(self) -> list[ModelScore]:
        """Best full index first (rank, then score)."""
        return sorted(self.models, key=lambda m: (m.rank, -m.full.value))


def _bundle_key(run_dir: Path) -> str:
    try:
        return RunStages.read(run_dir).root["bundle"].key
    except (OSError, KeyError, ValueError) as e:
        raise InputError(f"no bundle in stages.json ({type(e).__name__}): not a finished run folder",
                         file=str(run_dir)) from None


def _labels(run_dirs: list[Path]) -> tuple[list[str], list[str]]:
    """Each run's model name (campaign.json) and its label: the name, or name@run-folder when repeated."""
    from jex.tasks.campaign_spec import load_spec

    models = []
    for run_dir in run_dirs:
        try:
            models.append(load_spec(run_dir).engine.model_name())  # a served one: openai:NAME
        except (OSError, ValueError) as e:
            raise InputError(f"campaign.json unreadable ({type(e).__name__}): not a run folder",
                             file=str(run_dir)) from None
    short = [m.partition(":")[0] + ":" + Path(m.partition(":")[2]).name if m.startswith(SERVED_PREFIX) else
             Path(m).name if Path(m).exists() else m for m in models]
    labels = [s if short.count(s) == 1 else f"{s}@{d.name}" for s, d in zip(short, run_dirs, strict=True)]
    return models, labels


def compare_runs(run_dirs: Sequence[str | Path], *, draws: int | None = None, seed: int | None = None,
                 permutations: int = 2000) -> Comparison:
    """The comparison of finished runs of one bundle (refused in one line when their bundles differ).

    `draws`, `seed`: the bootstrap's, by default the first run's campaign's (`bootstrap_draws`, `_seed`)."""
    from jex.lab.experiment_report import predictions, stage_summaries
    from jex.lab.experiment_stats import paired_stats, shared_draws
    from jex.tasks.bundle.suite_table import load_suite_table
    from jex.tasks.campaign_spec import load_spec

    dirs = [Path(d) for d in run_dirs]
    if len(dirs) < 2:
        raise InputError("a comparison needs at least two run folders")
    if len({d.resolve() for d in dirs}) < len(dirs):
        raise InputError("a run folder is named twice", file=str(dirs[0]))
    keys = [_bundle_key(d) for d in dirs]
    for d, key in zip(dirs[1:], keys[1:], strict=True):
        if key != keys[0]:
            raise InputError(f"the runs read different bundles ({keys[0][:12]} and {key[:12]}): models are compared "
                             "on the same rows of one bundle", file=str(d), field="bundle")
    models, labels = _labels(dirs)
    first = load_spec(dirs[0])
    draws, seed = draws or first.bootstrap_draws, first.bootstrap_seed if seed is None else seed
    bundle = stage_summaries(dirs[0]).bundle
    table = load_suite_table(bundle.bundle)
    spec = table.spec
    shared = shared_draws(table.rows, spec, {lab: predictions(d) for lab, d in zip(labels, dirs, strict=True)},
                          draws=draws, seed=seed)
    pairs = []
    for a, b in combinations(labels, 2):
        st = paired_stats(shared, spec, a, b, permutations=permutations)
        pairs.append(PairDifference(
            a=a, b=b, full=Interval(value=st.full.delta, ci=st.full.ci), p=st.p,
            legs={k: Interval(value=d.delta, ci=d.ci) for k, d in st.legs.items()},
            catalogs={k: Interval(value=d.delta, ci=d.ci) for k, d in st.catalogs.items()}))
    above = {lab: 0 for lab in labels}  # models separated above each one
    for pair in pairs:
        if pair.separated():  # b - a's interval above zero: b is better, a has one more model above it
            above[pair.a if pair.full.ci[0] > 0 else pair.b] += 1
    entries = []
    for model, lab, d in zip(models, labels, dirs, strict=True):
        per_draw, point = shared.per_draw[lab], shared.points[lab]
        entries.append(ModelScore(
            label=lab, model=model, run_dir=str(d.resolve()), rank=1 + above[lab],
            full=Interval(value=point.full, ci=_interval(per_draw["full"])),
            legs={leg: Interval(value=point.legs[leg]["index"], ci=_interval(per_draw["legs"][leg]))
                  for leg in spec.legs},
            catalogs={c.id: Interval(value=100.0 * point.catalogs[c.id].skill,
                                     ci=_interval(100.0 * per_draw["catalogs"][c.id])) for c in spec.catalogs},
            acc={c.id: point.catalogs[c.id].acc for c in spec.catalogs}))
    return Comparison(bundle=keys[0], rows=table.rows.height, draws=draws, seed=seed, permutations=permutations,
                      models=entries, pairs=pairs,
                      provenance=provenance(inputs={"bundle": bundle.sha256},
                                            settings={"draws": draws, "seed": seed, "permutations": permutations},
                                            runs=[str(d.resolve()) for d in dirs]))


def _interval(samples: object) -> tuple[float, float]:
    from jex.tasks.scoring.bootstrap_ci import interval

    lo, hi = interval(samples)  # type: ignore[arg-type]
    return lo, hi


def _ci(x: Interval) -> str:
    return f"{x.value:.2f} [{x.ci[0]:.2f}, {x.ci[1]:.2f}]"


def render_comparison(doc: Comparison, *, plot: str | None = COMPARE_PLOT) -> str:
    """`compare.md`: the leaderboard, every pair's paired difference, and per catalog and leg."""
    board = doc.leaderboard()
    legs = list(board[0].legs)
    lines = [f"# {len(board)} models, one bundle ({doc.bundle[:12]}, {doc.rows} rows)", "",
             f"Scores with 95% intervals; differences paired on the same rows and the same {doc.draws} clustered "
             f"bootstrap draws (seed {doc.seed}); p: sign-flip permutation ({doc.permutations}). A model's rank is "
             "1 + the models whose paired difference over it excludes zero: models no interval separates share "
             "a rank.", "",
             "| rank | model | full index | " + " | ".join(legs) + " |",
             "|---:|---|---:|" + "---:|" * len(legs)]
    lines += [f"| {m.rank} | {m.label} | {_ci(m.full)} | " + " | ".join(_ci(m.legs[g]) for g in legs) + " |"
              for m in board]
    if plot:
        lines += ["", f"![models and pairs]({plot})"]
    lines += ["", "## Pairs (b - a, paired)", "", "| b - a | full index | p | separated | " + " | ".join(legs) + " |",
              "|---|---:|---:|---|" + "---:|" * len(legs)]
    lines += [f"| {p.b} - {p.a} | {_ci(p.full)} | {p.p:.4f} | {'yes' if p.separated() else 'no'} | "
              + " | ".join(_ci(p.legs[g]) for g in legs) + " |" for p in doc.pairs]
    catalogs = list(board[0].catalogs)
    lines += ["", "## Catalogs (skill x 100, 95% interval; accuracy)", "",
              "| catalog | " + " | ".join(m.label for m in board) + " |", "|---|" + "---:|" * len(board)]
    lines += [f"| {c} | " + " | ".join(f"{_ci(m.catalogs[c])}; {m.acc[c]:.3f}" for m in board) + " |"
              for c in catalogs]
    lines += ["", "## Catalog differences (b - a, skill x 100, paired)", "",
              "| catalog | " + " | ".join(f"{p.b} - {p.a}" for p in doc.pairs) + " |",
              "|---|" + "---:|" * len(doc.pairs)]
    lines += [f"| {c} | " + " | ".join(_ci(p.catalogs[c]) for p in doc.pairs) + " |" for c in catalogs]
    lines += ["", "## Runs", ""] + [f"- {m.label}: `{m.model}`, {m.run_dir}" for m in doc.models]
    return "\n".join(lines) + "\n"


def comparison_plot(doc: Comparison, path: Path) -> None:
    """Forest plot: every model's full index with its interval, then every pair's paired difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board, pairs = doc.leaderboard(), doc.pairs
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 2.2 + 0.4 * (len(board) + len(pairs))),
                                      height_ratios=[max(1, len(board)), max(1, len(pairs))])
    for ax, items, title in ((top, [(m.label, m.full) for m in board], "full index, 95% interval"),
                             (bottom, [(f"{p.b} - {p.a}", p.full) for p in pairs], "paired difference, 95% interval")):
        for i, (_name, x) in enumerate(items):
            color = "tab:green" if ax is bottom and x.separated() else "tab:blue"
            ax.errorbar(x.value, i, xerr=[[x.value - x.ci[0]], [x.ci[1] - x.value]], fmt="o", color=color, capsize=3)
        ax.set_yticks(range(len(items)), [n for n, _ in items])
        ax.invert_yaxis()
        ax.set(xlabel=title)
    bottom.axvline(0, color="black", lw=0.8)
    fig.tight_layout()
    with_tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(with_tmp, dpi=100)
    plt.close(fig)
    with_tmp.replace(path)


def comparison_folder(out: str | Path, name: str, run_dirs: Sequence[str | Path]) -> Path:
    """Where a campaign's comparison of its models' runs lies: `OUT/compare-NAME-HASH`, HASH from the run
    folders' names (content identities), in their order."""
    return Path(out) / f"compare-{name}-{sha256_json([Path(d).name for d in run_dirs])[:10]}"


def write_comparison(doc: Comparison, out: str | Path) -> Path:
    """`compare.json`, `compare.md` and `compare.png` into `out`; returns the folder."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    comparison_plot(doc, out / COMPARE_PLOT)
    write_json(out / COMPARE_JSON, doc.model_dump(mode="json"))
    write_text(out / COMPARE_MD, render_comparison(doc))
    return out
