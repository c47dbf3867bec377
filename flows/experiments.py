"""Engine experiments as flows: the batch-invariance bake-off and engine parity, with their reports as artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from jex.fileio import write_json, write_text


@flow(name="bakeoff", log_prints=True)
def bakeoff(arms: list[str] = ["hf-control", "hf-bi"], model: str | None = None,  # noqa: B006 - UI form default
            prompts: int = 32, tokens: int = 256, ladder: list[int] = [1, 8, 16, 32],  # noqa: B006
            repeats: int = 2, max_num_seqs: int = 32, device: str = "cpu", out: str = "runs/bakeoff") -> dict[str, Any]:
    """Each arm in its own process; the verdict and the table become a Prefect artifact."""
    from jex.tasks.lab.bakeoff import run_bakeoff

    res = run_bakeoff(arms, model=model, prompts=prompts, tokens=tokens, ladder=ladder, repeats=repeats,
                      max_num_seqs=max_num_seqs, device=device, out_dir=Path(out))
    create_markdown_artifact(markdown=(Path(out) / "bakeoff.md").read_text(), key="bakeoff-report")
    print(res["verdict"])
    return {"verdict": res["verdict"], "tax": res["tax"], "errors": res["errors"], "out": out}


@flow(name="parity", log_prints=True)
def parity(suite: str, engine_a: str = "hf", engine_b: str = "hf-batched", model: str | None = None, rows: int = 0,
           reason_rows: int = 0, max_tokens: int = 96, device: str = "cpu", batch_size: int = 8,
           out: str = "runs/parity") -> dict[str, Any]:
    """Readout parity (and choice parity after a rationale) of two engines on the same rows."""
    from jex.suite import iter_rows
    from jex.tasks.lab.parity import markdown, parity_of_kinds

    picked = list(iter_rows(suite))
    picked = picked[:rows] if rows else picked
    res = parity_of_kinds(engine_a, engine_b, picked, model=model, device=device, batch_size=batch_size,
                          reason_rows=reason_rows, max_tokens=max_tokens)
    text = markdown(res, (engine_a, engine_b))
    write_json(Path(out) / "parity.json", res)
    write_text(Path(out) / "parity.md", text)
    create_markdown_artifact(markdown=text, key="parity-report")
    return {k: v for k, v in res["readout"].items() if k != "flip_rows"}
