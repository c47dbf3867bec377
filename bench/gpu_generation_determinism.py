"""Issue 45, item 4: jex's generations on a GPU are the same bytes whatever the batch and shard settings.

The GSM8K-shaped task of `bench/gpu_peer.py` (its `gsm8k` cell), imported and run by jex once with its
defaults, then once per `--variant` (extra `jex run` flags: a scheduler width, a shard size, engines per
GPU) in a store of its own that starts from the first run's compile cache and stored bake-off. Reported:
each run's wall and generate-stage seconds, the rows whose generated text differs from the first run's,
and a sha256 over every row's generated text and token count, which must be
the same. On the device, after the staging of `bench/gpu_peer.py`:

    source /tmp/stage/env.sh && source bench/device_jex.sh && export PYTHONPATH=$PYTHONPATH:/tmp/site4
    python3 bench/gpu_generation_determinism.py --model /tmp/smollm2 --rows 400 \\
        --variant "--max-num-seqs 32 --reason-shard-rows 50" --out $OUT/determinism.json

`--jex-args` go to every run (e.g. `--spec audit-off.toml` to leave the settings audit out of a short
device call: the runs are compared directly here). `--cpu`: a smoke run on the HF engine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_peer  # noqa: E402  (the cell's task and jex runner)


def token_digest(run_dir: Path, task: str) -> str:
    """sha256 over the catalog's rows in doc_id order: each row's generated text and token count."""
    rows = gpu_peer.jex_rows(run_dir, task)
    h = hashlib.sha256()
    for d in sorted(rows):
        h.update(json.dumps([d, rows[d]["generation"], rows[d]["generation_tokens"]]).encode())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--max-gen-toks", type=int, default=256)
    p.add_argument("--variant", action="append", default=[], help="extra `jex run` flags of one more run")
    p.add_argument("--jex-args", type=shlex.split, default=[])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu-determinism"))
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    env = gpu_peer.bench_env()
    task = gpu_peer.make_tasks("gsm8k", a.rows, a.work / "tasks", a.max_gen_toks)
    first_dir = a.work / "run-0"
    runs: list[dict] = []
    first_texts: dict[int, str] = {}
    for i, variant in enumerate(["", *a.variant]):
        extra = [*a.jex_args, *shlex.split(variant)]
        res = gpu_peer.run_jex(task, a.model, a.work / f"run-{i}", env, first_dir / "store" if i else None, a.cpu,
                               extra, None)
        run_dir = Path(res["run_dir"])
        texts = {d: r["generation"] for d, r in gpu_peer.jex_rows(run_dir, task.stem).items()}
        first_texts = first_texts or texts
        runs.append({"variant": variant or "(defaults)", "wall_s": res["wall_s"],
                     "generate_stage_s": res["stages"].get("generate", {}).get("seconds"),
                     "generation_differences_vs_first": gpu_peer.differing(first_texts, texts),
                     "digest": token_digest(run_dir, task.stem), "run": res})
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "run"}), flush=True)
        a.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": a.rows, "runs": runs}, indent=2,
                                    default=str))


if __name__ == "__main__":
    main()
