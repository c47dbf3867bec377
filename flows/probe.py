"""The early-exit checkpoint probe as a flow: its report becomes a Prefect artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from jex.engine_spec import EngineSpec
from jex.fileio import write_json, write_text


@flow(name="early-exit-probe", log_prints=True)
def early_exit_probe(suite: str, rows: int = 200, every: int = 8, max_tokens: int = 128,
                     engine: EngineSpec = EngineSpec(), out: str = "runs/probe") -> dict[str, Any]:  # noqa: B008
    """Probe `rows` gated rows of a suite folder or bundle; writes probe.json, probe.md, probe.png."""
    from jex.tasks.capture.engine_pool import get_engine
    from jex.tasks.lab.early_exit import markdown, pick_gated, plot, probe_rows, suite_rows

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    eng = get_engine(engine)
    picked = pick_gated(eng, suite_rows(suite, out_dir), rows, render=engine.render)
    result = probe_rows(eng, picked, every=every, max_tokens=max_tokens, render=engine.render)
    text = markdown(result)
    write_json(out_dir / "probe.json", result.model_dump(mode="json"))
    write_text(out_dir / "probe.md", text)
    plot(result, out_dir / "probe.png")
    create_markdown_artifact(markdown=text, key="early-exit-probe")
    print(text.splitlines()[4] if len(text.splitlines()) > 4 else text)
    return {"full_accuracy": result.full_accuracy, "gate_fire_rate": result.gate_fire_rate,
            "first_matching_checkpoint": result.first_matching_checkpoint, "out": str(out_dir)}
