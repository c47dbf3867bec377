"""`jex export hub`: a run's results and samples as a Hugging Face Hub results dataset, in the layout lm-eval's
`EvaluationTracker` pushes (`lm_eval/loggers/evaluation_tracker.py`, 0.4.13): `<model>/results_<date>.json`,
`<model>/samples_<task>_<date>.jsonl` (the files `export_lm_eval` writes) and a dataset card (`README.md`) whose
configs are `<model>__results` and `<model>__<task>`, each with a `<date>` split and a `latest` one, as its
`recreate_metadata_card` builds them. `datasets.load_dataset(DIR, "<model>__results", split="latest")` reads it.

The card covers every export in the folder (a model's newest in each config, as lm-eval's card does). Pushing
(`repo_id`) needs the Hub and a token (`HF_TOKEN`, or `hf auth login`): checked before anything is written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from jex.errors import InputError
from jex.extras import needs_extra
from jex.tasks.outputs.interop.lm_eval_files import export_lm_eval

CARD = "README.md"


def export_hub(run_dir: str | Path, out: str | Path, *, repo_id: str | None = None, public: bool = False) -> Path:
    """Write the run into the results folder `out` (made when missing) and its card; with `repo_id`, push the folder
    to that Hub dataset repository (private unless `public`). Returns the folder."""
    out = Path(out)
    token = _hub_token(repo_id) if repo_id else None
    export_lm_eval(run_dir, out)
    write_card(out)
    if repo_id and token:
        _push(out, repo_id, token, public=public)
    return out


def write_card(out: Path) -> None:
    """The folder's dataset card: lm-eval's configs over the results and samples files it holds, and its summary
    (the newest results)."""
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard, DatasetCardData

    u = needs_extra("lm_eval.utils", "interop")
    files = sorted(p.relative_to(out).as_posix() for p in out.glob("*/*_*.json*"))
    newest: dict[str, tuple[str, str]] = {}  # config -> (date, file)
    for f in u.get_results_filenames(files) + u.get_sample_results_filenames(files):
        model, name = f.split("/", 1)
        task = "results" if name.startswith("results_") else u.sanitize_task_name(u.get_file_task_name(name))
        date = _file_date(u, name)
        newest[f"{model}__{task}"] = max(newest.get(f"{model}__{task}", ("", "")), (date, f))
    configs = MetadataConfigs({config: {"data_files": [{"split": re.sub(r"[^\w.]", "_", date), "path": [f]},
                                                       {"split": "latest", "path": [f]}]}
                               for config, (date, f) in sorted(newest.items())})
    latest = max((v for k, v in newest.items() if k.endswith("__results")), default=None)
    if latest is None:
        raise InputError("no results file to describe", file=str(out))
    results = json.loads((out / latest[1]).read_text(encoding="utf-8"))
    data = DatasetCardData(pretty_name=f"Evaluation run of {results['model_name']}",
                           dataset_summary=_summary(results, configs, latest))
    configs.to_dataset_card_data(data)
    DatasetCard.from_template(data, pretty_name=data.pretty_name).save(out / CARD)


def _file_date(u: Any, name: str) -> str:
    # lm-eval's `get_file_datetime` strips `.jsonl` only: a results file's date would keep its `.json`
    return str(u.get_file_datetime(name)).removesuffix(".json")


def _summary(results: dict[str, Any], configs: Any, latest: tuple[str, str]) -> str:
    """lm-eval's card text: what the dataset holds, how to load it, the latest results."""
    model_dir = latest[1].split("/", 1)[0]
    shown = json.dumps({"all": results["results"], **results["results"]}, indent=4)
    return (f"Dataset created by `jex export hub` from a jex run of {results['model_name']}, in the layout of "
            "lm-evaluation-harness's EvaluationTracker. It is composed of "
            f"{len(configs) - 1} configuration(s), each one corresponding to one of the evaluated tasks, and "
            f'"{model_dir}__results" with the aggregated results. Each run is a split named by its timestamp; '
            '"latest" is the newest.\n\n'
            "```python\nfrom datasets import load_dataset\n"
            f'data = load_dataset(REPO_OR_FOLDER, name="{model_dir}__results", split="latest")\n```\n\n'
            f"## Latest results\n\nThese are the latest results ({latest[0]}):\n\n```python\n{shown}\n```")


def _hub_token(repo_id: str) -> str:
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise InputError(f"pushing to the Hub dataset {repo_id} needs a Hugging Face token with write access: set "
                         "HF_TOKEN or run `hf auth login` (or leave out --repo-id to write the folder only)",
                         field="--repo-id")
    return token


def _push(out: Path, repo_id: str, token: str, *, public: bool) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id=repo_id, repo_type="dataset", private=not public, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(out), repo_type="dataset",
                          commit_message=f"jex export hub: {out.name}")
    except (HfHubHTTPError, OSError) as e:
        raise InputError(f"the Hub refused the push: {str(e).splitlines()[0]} (the folder is written: {out})",
                         field="--repo-id") from None
