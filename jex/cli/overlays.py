"""`jex overlays mine|gate|ladder`: overlays on a finished run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from jex.cli import preflight
from jex.cli.common import fail, print_path
from jex.errors import InputError, JexError
from jex.settings import load_settings

overlays_app = typer.Typer(no_args_is_help=True, help="Overlays on a finished run: mine, gate (the pre-registered "
                                                       "test), ladder.")


@overlays_app.command("mine")
def overlays_mine(run: Annotated[Path, typer.Argument(help="A finished run folder")],
                  out: Annotated[Path, typer.Option("-o", "--out", help="Folder for mining.json, candidates.toml")],
                  top: int = 5) -> None:
    """Propose candidate rules where errors are systematic, with their out-of-fold gain."""
    from jex.fileio import write_json, write_text
    from jex.lab.overlay_lab import candidate_rules_toml, load_capture, mine

    try:
        preflight.writable_dir(out, "--out")
        preflight.at_least(top, "--top", 1)
        doc = mine(load_capture(run))
    except JexError as e:
        fail(e)
    write_json(out / "mining.json", doc)
    write_text(out / "candidates.toml", candidate_rules_toml(doc["candidates"], top=top))
    for c in doc["candidates"][:top]:
        typer.echo(f"{c['catalog']:>14} {c['kind']:<22} oof gain {c['oof_gain_full']:+.3f}")
    print_path(out / "candidates.toml")


@overlays_app.command("gate")
def overlays_gate(run: Annotated[Path, typer.Argument(help="A finished run folder")],
                  rules: Annotated[Path, typer.Option(help="Rule file (TOML)")],
                  out: Annotated[Path, typer.Option("-o", "--out", help="Folder for gate-settings.json, gate.json")],
                  alpha: float = 0.05, permutations: int = 200,
                  draws: Annotated[int | None, typer.Option(help="Bootstrap draws (default: JEX_BOOTSTRAP_DRAWS)")]
                  = None,
                  seed: Annotated[int | None, typer.Option(help="Bootstrap seed (default: JEX_BOOTSTRAP_SEED)")]
                  = None,
                  catalog_tolerance: Annotated[float, typer.Option(help="No-degrade: the most any catalog's skill "
                                                                        "may drop (index points)")] = 1.0) -> None:
    """The pre-registered test: settings hashed first (written once per folder); CI above zero, permutation
    p < alpha, no-degrade (other catalogs bit-identical, no catalog's skill dropping beyond the tolerance).
    Each rule's verdict goes to the run's store ledger: a campaign applies a rule only with a PASS there."""
    from jex.lab.overlay_lab import OverlayTestSettings, load_capture, overlay_test
    from jex.overlays import load_rule_file

    settings = load_settings()
    draws = settings.bootstrap_draws if draws is None else draws
    seed = settings.bootstrap_seed if seed is None else seed
    try:
        preflight.writable_dir(out, "--out")
        for flag, value in (("--permutations", permutations), ("--draws", draws)):
            preflight.at_least(value, flag, 1)
        preflight.at_least(seed, "--seed", 0)
        if not 0 < alpha < 1:
            raise InputError(f"--alpha: expected a number between 0 and 1, got {alpha:g}")
        chosen = [r for r in load_rule_file(preflight.existing_file(rules, "--rules")) if r.enabled]
        doc = overlay_test(load_capture(run), chosen, OverlayTestSettings(
            alpha=alpha, draws=draws, seed=seed, permutations=permutations, catalog_tolerance=catalog_tolerance), out)
        path, added = record_gate(doc, chosen, run, out)
    except JexError as e:
        fail(e)
    typer.echo(f"ledger: {added} gate record(s) appended to {path}")
    for r in doc["results"]:
        failed = [k for k, v in r["checks"].items() if not v]
        typer.echo(f"{r['rule']['id']}: {'PASS' if r['passed'] else 'FAIL ' + ', '.join(failed)} "
                   f"(gain {r['gain_full']:+.3f}, CI {r['ci_full'][0]:+.3f}..{r['ci_full'][1]:+.3f}, "
                   f"p {r['permutation_p']:.4f})" + (f": {r['no_degrade_error']}" if r["no_degrade_error"] else ""))
    print_path(out)


def record_gate(doc: Any, rules: list[Any], run: Path, out: Path) -> tuple[Path, int]:
    """Append each rule's verdict to the store ledger of the run (the store that holds its stages now)."""
    from jex.flows.campaign import resume_spec
    from jex.lab.overlay_lab import gate_decisions
    from jex.tasks.decisions import append_decisions, ledger_path, model_facts

    spec = resume_spec(run)
    name, params = model_facts(spec.engine)
    path = ledger_path(spec.store)
    return path, len(append_decisions(path, gate_decisions(doc, rules, run, source=out, model_name=name,
                                                           model_params=params)))


@overlays_app.command("ladder")
def overlays_ladder(run: Annotated[Path, typer.Argument(help="A finished run folder")],
                    rules: Annotated[Path, typer.Option(help="Rule file (TOML), applied in declared order")],
                    out: Annotated[Path, typer.Option("-o", "--out", help="Folder for ladder.json, disclosure.md")],
                    gate_record: Annotated[Path | None, typer.Option("--gate", help="gate.json: keep its passes")]
                    = None) -> None:
    """Ladder, leave-one-outs, no-degrade and reversibility checks, and the disclosure sheet."""
    from jex.fileio import write_json, write_text
    from jex.lab.overlay_lab import disclosure, ladder, load_capture
    from jex.overlays import load_rule_file

    try:
        preflight.writable_dir(out, "--out")
        chosen = [r for r in load_rule_file(preflight.existing_file(rules, "--rules")) if r.enabled]
        if gate_record is not None:
            passed = preflight.json_file(gate_record, "--gate").get("passed")
            if not isinstance(passed, list):
                raise InputError("--gate: expected a gate.json of `jex overlays gate` (a 'passed' list)",
                                 file=str(gate_record), field="passed")
            chosen = [r for r in chosen if r.id in set(map(str, passed))]
        doc = ladder(load_capture(run), chosen)
    except JexError as e:
        fail(e)
    write_json(out / "ladder.json", doc)
    write_text(out / "disclosure.md", disclosure(doc, chosen))
    for s in doc["steps"]:
        typer.echo(f"{s['step']:>24} {s['full']:.4f}")
    print_path(out / "disclosure.md")


def register(app: typer.Typer) -> None:
    app.add_typer(overlays_app, name="overlays")
