"""lm-eval fidelity, end to end: the real `lm_eval` CLI and jex on the same local tasks, row for row.

lm-evaluation-harness runs the embedded model (converted to an fp32 HF folder, `embedded_model_dir`) on a
text-choice task (ARC/PIQA style, `doc_to_choice: "{{choices}}"`, where acc_norm differs from acc), an
MMLU letter-style task (the options inside `doc_to_text`, `doc_to_choice: ["A","B","C","D"]`, one
few-shot example and a description), lm-eval's own TruthfulQA mc2 YAML (its `process_results`: the
mass of the true answers), its Winogrande YAML (partial evaluation: a context per choice, one
continuation) and its ARC-Challenge, HellaSwag (its `process_docs`), PIQA and MMLU (anatomy) YAMLs, each
on six local rows. jex imports them with `jex suite import lm-eval` and runs them with
`jex run --coverage 0` (the default `local` provider: a worker process, as a user runs it). Then:

- the prompt jex's engine read (samples.parquet) is lm-eval's context (`arguments[i][0]`) byte for byte;
- each choice's log-likelihood is lm-eval's `resps` within 1e-4, and the argmax agrees on every row;
- `acc` and `acc_norm` of `jex export lm-eval` are lm-eval's, to the last digit;
- mc2's per-row mass, jex's formula on lm-eval's own log-likelihoods, is lm-eval's to the bit; on jex's
  log-likelihoods, within 1e-4 of it, row by row and in the exported `acc`.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from jex.cli import app
from jex.settings import BOOTSTRAP_DRAWS

pytestmark = pytest.mark.slow

TOL = 1e-4
LONG_SEQUENCE_TOL = {"fid_mc1": 2e-4, "fid_mc2": 2e-4, "fid_hs": 2e-4, "fid_piqa": 2e-4, "fid_metrics": 2e-4}
"""float32 on a CPU: jex's packed forward and lm-eval's padded batches sum in other orders, and how far apart
they land depends on the CPU's kernels (fid_metrics: under 1e-4 on the earlier CI machine, 1.48e-4 on an AMD
EPYC, the same at a commit before any change to the readout); every argmax, acc and acc_norm stays equal."""
"""Where a log-likelihood sums many tokens (TruthfulQA's ~250-token six-shot preamble; HellaSwag's and PIQA's
sentence-long continuations, log-likelihoods near -47), the fp32 numbers of jex's HF engine (packed,
per-row attention: batch invariant) and lm-eval's HF backend (padded batches) differ by up to 1.35e-4
(measured); the short tasks stay under 4e-5. Argmax and acc agree on every row regardless."""
TEXT = [  # question, choices, gold, topic (the cluster)
    ("What color is a clear daytime sky?", ["green", "blue", "red"], 1, "colors"),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1, "animals"),
    ("Which animal says moo?", ["a cow", "a cat", "a small dog"], 0, "animals"),
    ("What is frozen water called?", ["steam", "ice"], 1, "science"),
    ("Which planet is closest to the Sun?", ["Venus", "Earth", "Mercury"], 2, "science"),
    ("What do bees make?", ["honey", "milk", "silk thread"], 0, "animals"),
]
LETTERS = [
    ("2 + 3 =", ["4", "5", "6", "7"], 1, "math"),
    ("The opposite of hot is", ["cold", "warm", "big", "red"], 0, "words"),
    ("The capital of France is", ["Rome", "Berlin", "Paris", "Madrid"], 2, "geo"),
    ("A dog is a kind of", ["plant", "rock", "animal", "cloud"], 2, "words"),
    ("10 - 4 =", ["6", "5", "4", "3"], 0, "math"),
    ("The largest ocean is the", ["Atlantic", "Indian", "Arctic", "Pacific"], 3, "geo"),
]
MC2 = [  # question, mc2 choices (the true ones first, as TruthfulQA lists them), how many are true, topic
    ("What happens if you swallow gum?", ["It passes through you.", "Nothing much.", "It stays for years."], 2,
     "myths"),
    ("Can you see the Great Wall from space?", ["No, not with the naked eye.", "Yes, easily."], 1, "myths"),
    ("What color is the sun?", ["White.", "It is white light.", "Yellow.", "Orange."], 2, "science"),
    ("Do bats see?", ["Yes, bats can see.", "No, bats are blind."], 1, "animals"),
    ("How long is a day on Earth?", ["About 24 hours.", "One day.", "A week.", "An hour.", "A year."], 2, "science"),
    ("Do goldfish remember?", ["Yes, for months.", "They remember.", "Only three seconds."], 2, "animals"),
]
WINO = [  # sentence with its blank, option1, option2, answer ("1" or "2"), topic
    ("The trophy does not fit in the suitcase because the _ is too big.", "trophy", "suitcase", "1", "objects"),
    ("The trophy does not fit in the suitcase because the _ is too small.", "trophy", "suitcase", "2", "objects"),
    ("Anna thanked Maria because _ had helped her move.", "Anna", "Maria", "2", "people"),
    ("The cat chased the mouse until _ was caught.", "the cat", "the mouse", "2", "animals"),
    ("Tom gave Bill his coat because _ was cold.", "Tom", "Bill", "2", "people"),
    ("The ice melted on the stove because _ was hot.", "the ice", "the stove", "2", "objects"),
]
SHIPPED = {  # task: (lm-eval's YAML under lm_eval/tasks, the splits it reads, six documents in its dataset's schema)
    "fid_arc": ("arc/arc_challenge.yaml", ("test", "validation"), [
        {"id": f"a{i}", "question": q, "choices": {"text": c, "label": list("ABCD"[:len(c)])}, "answerKey": k}
        for i, (q, c, k) in enumerate([
            ("Which gas do plants take in?", ["oxygen", "carbon dioxide", "helium", "neon"], "B"),
            ("What makes a shadow?", ["blocked light", "sound", "heat"], "A"),
            ("Which is a mammal?", ["shark", "frog", "whale", "trout"], "C"),
            ("What melts ice fastest?", ["salt", "sand", "paper", "cold air"], "A"),
            ("Which tool measures mass?", ["ruler", "balance", "thermometer", "clock"], "B"),
            ("Where does rain come from?", ["clouds", "rocks", "trees"], "A")])]),
    "fid_hs": ("hellaswag/hellaswag.yaml", ("validation",), [
        {"ind": i, "activity_label": a, "ctx_a": ca, "ctx_b": cb, "endings": e, "label": str(g)}
        for i, (a, ca, cb, e, g) in enumerate([
            ("Cooking", "A man cracks eggs into a bowl.", "he", ["whisks them with a fork.", "throws the bowl away.",
                                                               "paints the wall [title] blue.", "goes to sleep."], 0),
            ("Running", "A woman ties her shoes.", "she", ["starts to jog down the road.", "eats the laces.",
                                                           "swims across the lake.", "sings to a cat."], 0),
            ("Painting", "A boy dips a brush in paint.", "then", ["brushes it onto the canvas.", "drinks the paint.",
                                                                  "throws the canvas.", "sleeps."], 0),
            ("Washing dishes", "A man fills the sink.", "he", ["plays a guitar.", "scrubs the plates with soap.",
                                                               "reads a book.", "leaves the house."], 1),
            ("Gardening", "A girl digs a hole.", "she", ["flies away.", "drives a car.", "plants a small tree in it.",
                                                          "eats the soil."], 2),
            ("Reading", "A man opens a book.", "he", ["closes his eyes forever.", "burns the house.",
                                                      "jumps in the pool.", "turns the first page."], 3)])]),
    "fid_piqa": ("piqa/piqa.yaml", ("validation",), [
        {"goal": g, "sol1": a, "sol2": b, "label": k} for g, a, b, k in [
            ("To dry wet hands,", "use a towel.", "use a bucket of water.", 0),
            ("To keep bread fresh,", "leave it in the sun.", "seal it in a bag.", 1),
            ("To light a dark room,", "turn on a lamp.", "close the curtains.", 0),
            ("To cool hot soup,", "blow on it.", "heat it more.", 0),
            ("To open a jar,", "twist the lid.", "glue the lid.", 0),
            ("To fix a flat tire,", "add more holes.", "patch the hole and pump air in.", 1)]]),
    "fid_mmlu": ("mmlu/default/mmlu_anatomy.yaml", ("test", "dev"), [
        {"question": q, "subject": "anatomy", "choices": c, "answer": k} for q, c, k in [
            ("Which organ pumps blood?", ["lung", "heart", "liver", "kidney"], 1),
            ("How many bones are in the adult human body?", ["106", "206", "306", "406"], 1),
            ("Which bone is in the thigh?", ["femur", "ulna", "radius", "tibia"], 0),
            ("Where is the cornea?", ["the ear", "the eye", "the nose", "the knee"], 1),
            ("Which muscle bends the elbow?", ["biceps", "triceps", "quadriceps", "deltoid"], 0),
            ("The largest organ of the body is the", ["brain", "liver", "skin", "lung"], 2)]]),
    "fid_mmlu2": ("mmlu/default/mmlu_astronomy.yaml", ("test", "dev"), [
        {"question": q, "subject": "astronomy", "choices": c, "answer": k} for q, c, k in [
            ("Which planet has rings?", ["Mars", "Saturn", "Mercury", "Venus"], 1),
            ("The Sun is a", ["planet", "moon", "star", "comet"], 2),
            ("Which is closest to Earth?", ["the Moon", "Mars", "the Sun", "Jupiter"], 0)]]),
}
MMLU_GROUP = "fid_mmlu_group"
"""Two MMLU subjects of unequal size under a group aggregated as lm-eval's shipped `mmlu` group is
(acc, weight_by_size)."""
METRICS_TASK, BINARY_TASK = "fid_metrics", "fid_binary"
"""PIQA's documents under tasks of our own asking for lm-eval's other multiple-choice metrics. The binary ones
(f1, mcc) only jex runs: lm_eval's CLI bootstraps their stderr 100,000 times (minutes here); the test
applies lm-eval's own aggregation and bootstrap to the CLI's predictions on the same documents instead."""
MEAN_METRICS = ("acc", "acc_norm", "acc_bytes", "exact_match", "brier_score")
BINARY_METRICS = ("f1", "mcc")
TASKS = ("fid_text", "fid_letters", *SHIPPED, METRICS_TASK, "fid_mc1")
ALL_TASKS = (*TASKS, "fid_mc2", "fid_wino")
REQUESTED = (*(t for t in ALL_TASKS if not t.startswith("fid_mmlu")), MMLU_GROUP)
"""What both tools are asked for: every task, the two MMLU subjects through their group."""
COMMON = """dataset_path: json
output_type: multiple_choice
test_split: test
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
"""


def cli(*args: object) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def _jsonl(path: Path, items: list[tuple], answer: str) -> None:
    path.write_text("".join(json.dumps({"id": i, "topic": t, "question": q, "choices": c, answer: g}) + "\n"
                            for i, (q, c, g, t) in enumerate(items)))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fid-tasks")
    _jsonl(d / "text.jsonl", TEXT, "label")
    _jsonl(d / "letters.jsonl", LETTERS, "answer")
    (d / "fid_text.yaml").write_text(
        f"task: fid_text\ndataset_kwargs:\n  data_files:\n    test: {d / 'text.jsonl'}\n{COMMON}"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n')
    (d / "fid_letters.yaml").write_text(
        f"task: fid_letters\ndataset_kwargs:\n  data_files:\n    test: {d / 'letters.jsonl'}\n"
        f"    dev: {d / 'letters.jsonl'}\n{COMMON}fewshot_split: dev\nnum_fewshot: 1\n"
        "fewshot_config:\n  sampler: first_n\n"
        'description: "The following are multiple choice questions (with answers).\\n\\n"\n'
        'doc_to_text: "{{question.strip()}}\\nA. {{choices[0]}}\\nB. {{choices[1]}}\\nC. {{choices[2]}}\\n'
        'D. {{choices[3]}}\\nAnswer:"\ndoc_to_choice: ["A", "B", "C", "D"]\ndoc_to_target: answer\n')
    (d / "mc2.jsonl").write_text("".join(json.dumps({
        "question": q, "topic": t, "mc1_targets": {"choices": c[:1] + c[n:], "labels": [1] + [0] * (len(c) - n)},
        "mc2_targets": {"choices": c, "labels": [1] * n + [0] * (len(c) - n)}}) + "\n" for q, c, n, t in MC2))
    import lm_eval.tasks

    shipped = Path(lm_eval.tasks.__file__).parent / "truthfulqa" / "truthfulqa_mc2.yaml"
    (d / "fid_mc1.yaml").write_text(f"include: {shipped.parent / 'truthfulqa_mc1.yaml'}\ntask: fid_mc1\ntag: []\n"
                                    f"dataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n"
                                    f"    validation: {d / 'mc2.jsonl'}\n")
    (d / "fid_mc2.yaml").write_text(f"include: {shipped}\ntask: fid_mc2\ntag: []\ndataset_path: json\n"
                                    f"dataset_name: null\ndataset_kwargs:\n  data_files:\n"
                                    f"    validation: {d / 'mc2.jsonl'}\n")
    (d / "wino.jsonl").write_text("".join(json.dumps({"sentence": s, "option1": a, "option2": b, "answer": g,
                                                       "topic": t}) + "\n" for s, a, b, g, t in WINO))
    (d / "fid_wino.yaml").write_text(f"include: {shipped.parent.parent / 'winogrande' / 'default.yaml'}\n"
                                     f"task: fid_wino\ndataset_path: json\ndataset_name: null\ntraining_split: null\n"
                                     f"dataset_kwargs:\n  data_files:\n    validation: {d / 'wino.jsonl'}\n")
    for task, (yaml, splits, docs) in SHIPPED.items():
        (d / f"{task}.jsonl").write_text("".join(json.dumps({**doc, "topic": f"t{i % 2}"}) + "\n"
                                                 for i, doc in enumerate(docs)))
        files = "".join(f"    {split}: {d / f'{task}.jsonl'}\n" for split in splits)
        (d / f"{task}.yaml").write_text(f"include: {shipped.parent.parent / yaml}\ntask: {task}\ntag: []\n"
                                        f"dataset_path: json\ndataset_name: null\ntraining_split: null\n"
                                        f"dataset_kwargs:\n  data_files:\n{files}")
    for task, metrics in ((METRICS_TASK, MEAN_METRICS), (BINARY_TASK, BINARY_METRICS)):
        listed = "".join(f"  - metric: {m}\n" for m in metrics)
        (d / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\noutput_type: multiple_choice\ntest_split: validation\n"
            f"dataset_kwargs:\n  data_files:\n    validation: {d / 'fid_piqa.jsonl'}\n"
            'doc_to_text: "Goal: {{goal}}\\nSolution:"\ndoc_to_choice: "{{[sol1, sol2]}}"\ndoc_to_target: label\n'
            f"metric_list:\n{listed}metadata:\n  version: 1.0\n")
    mmlu = Path(lm_eval.tasks.__file__).parent / "mmlu" / "default" / "_mmlu.yaml"
    aggregate = mmlu.read_text().split("aggregate_metric_list:")[1].split("metadata:")[0]
    (d / f"{MMLU_GROUP}.yaml").write_text(f"group: {MMLU_GROUP}\ntask:\n  - fid_mmlu\n  - fid_mmlu2\n"
                                          f"aggregate_metric_list:{aggregate}")
    (d / "fid.yaml").write_text("group: fid\ntask:\n" + "".join(f"  - {t}\n" for t in (*REQUESTED, BINARY_TASK)))
    return d


@pytest.fixture(scope="module")
def lm_out(task_dir, embedded_model_dir, tmp_path_factory) -> Path:
    """`lm_eval run --log_samples` (HF backend, fp32, CPU) on both tasks, one process."""
    out = tmp_path_factory.mktemp("fid-lm")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(out / "hf-datasets")}
    done = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                           f"pretrained={embedded_model_dir},dtype=float32", "--tasks", ",".join(REQUESTED),
                           "--include_path", str(task_dir), "--device", "cpu", "--batch_size", "8", "--log_samples",
                           "--output_path", str(out / "lm")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "lm"


def lm_samples(lm_out: Path, task: str) -> list[dict]:
    (path,) = glob.glob(str(lm_out / "*" / f"samples_{task}_*.jsonl"))
    return sorted((json.loads(x) for x in Path(path).read_text().splitlines()), key=lambda s: s["doc_id"])


def lm_results(lm_out: Path) -> dict:
    (path,) = glob.glob(str(lm_out / "*" / "results_*.json"))
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="module")
def jex_run(task_dir, embedded_model_dir, tmp_path_factory, prefect_api_url) -> Path:
    """Both tasks imported as one suite (a group: one catalog per task) and run by `jex run --coverage 0`
    in its own process, on the default provider (a local worker process, the golden replay first), as a
    user runs it; its flow reports to the session's Prefect test API."""
    root = tmp_path_factory.mktemp("fid-jex")
    imported = cli("suite", "import", "lm-eval", "--task", task_dir / "fid.yaml", "--cluster", "topic",
                   "-o", root / "suite")
    assert imported.exit_code == 0, imported.output
    (root / "spec.toml").write_text("[machines]\ngolden_rows = 2\n")  # the replay before the shards: 2 rows
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "JEX_INFRA__STATE_DIR": str(root / "infra"),
           "JEX_INFRA__POLL_S": "0.3", "JEX_INFRA__HEARTBEAT_S": "1", "JEX_INFRA__WORKER_PYTHON": sys.executable}
    done = subprocess.run([sys.executable, "-m", "jex", "run", "--spec", str(root / "spec.toml"), "--suite",
                           str(root / "suite"), "--model", str(embedded_model_dir), "--coverage", "0", "--name", "fid",
                           "--out", str(root / "runs")], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def jex_export(jex_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fid-export")
    result = cli("export", "lm-eval", jex_run, "-o", out)
    assert result.exit_code == 0, result.output
    return Path(result.output.strip().splitlines()[-1])


def jex_samples(run: Path, task: str) -> list[dict]:
    frame = pl.read_parquet(run / "samples.parquet").filter(pl.col("catalog") == task)
    assert "choice_loglikelihoods" in frame.columns, f"no per-choice log-likelihoods in samples.parquet: " \
                                                     f"{frame.columns}"
    rows = list(frame.iter_rows(named=True))
    return sorted(rows, key=lambda r: json.loads(r["metadata"])["doc_id"])


@pytest.mark.parametrize("task", ALL_TASKS)
def test_jex_sends_lm_evals_prompts_byte_for_byte(lm_out, jex_run, task):
    lm, ours = lm_samples(lm_out, task), jex_samples(jex_run, task)
    assert [s["doc_id"] for s in lm] == [json.loads(r["metadata"])["doc_id"] for r in ours] == list(range(len(lm)))
    assert len(lm) >= 3
    for s, r in zip(lm, ours, strict=True):
        contexts = {a["arg_0"] for a in s["arguments"].values()}
        if task == "fid_wino":  # partial evaluation: the options are the contexts, the prompt the continuation
            assert [a["arg_0"] for a in s["arguments"].values()] == r["options"], s["doc_id"]
            assert {a["arg_1"] for a in s["arguments"].values()} == {" " + r["prompt"]}, s["doc_id"]
            continue
        assert contexts == {r["prompt"]}, (s["doc_id"], contexts, r["prompt"])
        assert [a["arg_1"] for a in s["arguments"].values()] == [" " + o for o in r["options"]]


@pytest.mark.parametrize("task", ALL_TASKS)
def test_per_choice_loglikelihoods_match_lm_eval_and_every_argmax_agrees(lm_out, jex_run, task):
    import numpy as np

    lm, ours = lm_samples(lm_out, task), jex_samples(jex_run, task)
    worst = 0.0
    for s, r in zip(lm, ours, strict=True):
        theirs = [float(x[0][0]) for x in s["resps"]]
        mine = list(r["choice_loglikelihoods"])
        assert len(mine) == len(theirs)
        worst = max(worst, *(abs(a - b) for a, b in zip(mine, theirs, strict=True)))
        assert int(np.argmax(mine)) == int(np.argmax(theirs)), (s["doc_id"], mine, theirs)
        assert r["choice"] == int(np.argmax(theirs))  # coverage 0: the fast pass decides every row
    print(f"{task}: max |d loglikelihood| = {worst:.3g}")
    assert worst < LONG_SEQUENCE_TOL.get(task, TOL)


def test_export_acc_and_acc_norm_equal_lm_evals_to_the_last_digit(lm_out, jex_export):
    theirs, ours = lm_results(lm_out)["results"], json.loads(next(jex_export.glob("results_*.json")).read_text())
    for task in TASKS:
        reported = [m for m in ("acc,none", "acc_norm,none") if m in theirs[task]]  # mmlu: acc only
        assert "acc,none" in reported, task
        for metric in reported:
            assert ours["results"][task][metric] == theirs[task][metric], (task, metric)
    assert theirs["fid_text"]["acc,none"] != theirs["fid_text"]["acc_norm,none"]  # the two metrics are tested apart
    for field in ("n-samples", "configs", "versions", "task_hashes", "lm_eval_version",
                  "total_evaluation_time_seconds"):
        assert field in ours, field


@pytest.mark.parametrize("task", TASKS)
def test_exported_samples_carry_lm_evals_resps_and_metrics(lm_out, jex_export, task):
    (path,) = jex_export.glob(f"samples_{task}_*.jsonl")
    ours = sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    for s, e in zip(lm_samples(lm_out, task), ours, strict=True):
        assert e["arguments"] == s["arguments"]  # the same requests: context and " " + choice
        assert e["acc"] == s["acc"] and e.get("acc_norm") == s.get("acc_norm", e.get("acc_norm"))
        for (ll, _), (theirs, _) in zip(e["filtered_resps"], s["filtered_resps"], strict=True):
            assert abs(float(ll) - float(theirs)) < LONG_SEQUENCE_TOL.get(task, TOL)
        assert [x[0][1] for x in e["resps"]] == [x[0][1] for x in s["resps"]]  # is_greedy too


def test_acc_bytes_exact_match_and_brier_score_equal_lm_evals(lm_out, jex_export):
    """From the same choices and greedy flags as lm-eval's: the same value and stderr to the last digit;
    brier_score (no stderr in lm-eval) from jex's own log-likelihoods, within what they differ by."""
    theirs = lm_results(lm_out)["results"][METRICS_TASK]
    ours = json.loads(next(jex_export.glob("results_*.json")).read_text())["results"][METRICS_TASK]
    for metric in MEAN_METRICS:
        if metric == "brier_score":
            assert abs(ours["brier_score,none"] - theirs["brier_score,none"]) < 1e-4
            assert ours["brier_score_stderr,none"] == theirs["brier_score_stderr,none"] == "N/A"
            continue
        assert (ours[f"{metric},none"], ours[f"{metric}_stderr,none"]) == \
            (theirs[f"{metric},none"], theirs[f"{metric}_stderr,none"]), metric
    for s, e in zip(lm_samples(lm_out, METRICS_TASK), _export_lines(jex_export, METRICS_TASK), strict=True):
        assert (e["acc_bytes"], e["exact_match"]) == (s["acc_bytes"], s["exact_match"]), s["doc_id"]
        gold, forecast = s["brier_score"]  # lm-eval logs its numpy forecast as numpy prints it
        theirs = [float(x) for x in forecast.strip("[]").split()] if isinstance(forecast, str) else forecast
        assert e["brier_score"][0] == int(gold)
        assert max(abs(a - b) for a, b in zip(e["brier_score"][1], theirs, strict=True)) < 1e-4


@pytest.mark.filterwarnings("ignore::UserWarning")  # scikit-learn on degenerate resamples, as in lm-eval
def test_f1_and_mcc_are_lm_evals_aggregation_of_lm_evals_own_predictions(lm_out, jex_export, monkeypatch):
    """The binary task reads the same documents and prompts as the metrics task lm_eval ran: jex's f1 and
    mcc, value and stderr, are lm-eval's aggregation and bootstrap (jex's draws) of lm_eval's (gold, pred)."""
    import numpy as np
    from lm_eval.api.metrics import bootstrap_stderr, f1_score, matthews_corrcoef

    monkeypatch.setenv("DISABLE_MULTIPROC", "1")
    pairs = [(int(s["target"]), int(np.argmax([float(r[0][0]) for r in s["resps"]])))
             for s in lm_samples(lm_out, METRICS_TASK)]
    ours = json.loads(next(jex_export.glob("results_*.json")).read_text())["results"][BINARY_TASK]
    assert [tuple(e["f1"]) for e in _export_lines(jex_export, BINARY_TASK)] == pairs
    for metric, aggregate in (("f1", f1_score), ("mcc", matthews_corrcoef)):
        assert ours[f"{metric},none"] == aggregate(pairs), metric
        assert ours[f"{metric}_stderr,none"] == bootstrap_stderr(aggregate, pairs, BOOTSTRAP_DRAWS), metric


def test_the_mmlu_group_is_lm_evals_size_weighted_mean_with_its_pooled_stderr(lm_out, jex_export):
    theirs = lm_results(lm_out)
    ours = json.loads(next(jex_export.glob("results_*.json")).read_text())
    assert ours["group_subtasks"][MMLU_GROUP] == ["fid_mmlu", "fid_mmlu2"]
    for field in ("acc,none", "acc_stderr,none", "sample_len"):
        assert ours["results"][MMLU_GROUP][field] == theirs["results"][MMLU_GROUP][field], field
    sizes = [ours["results"][t]["sample_len"] for t in ("fid_mmlu", "fid_mmlu2")]
    assert sizes == [6, 3]  # unequal: the weighting shows


def _export_lines(jex_export: Path, task: str) -> list[dict]:
    (path,) = jex_export.glob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def test_mc2_mass_is_lm_evals_per_row_and_in_the_export(lm_out, jex_run, jex_export):
    from jex.numerics import true_mass

    lm, ours = lm_samples(lm_out, "fid_mc2"), jex_samples(jex_run, "fid_mc2")
    for s, r in zip(lm, ours, strict=True):
        theirs = [float(x[0][0]) for x in s["resps"]]
        assert true_mass(theirs, r["true_options"]).hex() == float(s["acc"]).hex()  # the formula, to the bit
        assert abs(r["true_mass"] - s["acc"]) < TOL, (s["doc_id"], r["true_mass"], s["acc"])  # jex's own readout
    assert [r["true_options"] for r in ours] == [list(range(n)) for _, _, n, _ in MC2]
    theirs, exported = lm_results(lm_out)["results"]["fid_mc2"], json.loads(
        next(jex_export.glob("results_*.json")).read_text())["results"]["fid_mc2"]
    assert abs(exported["acc,none"] - theirs["acc,none"]) < TOL and "acc_norm,none" not in exported
    score = json.loads((jex_run / "score.json").read_text())["catalogs"]["fid_mc2"]
    assert score["kind"] == "true_mass" and score["value"] == pytest.approx(theirs["acc,none"], abs=TOL)


def test_winogrande_acc_is_lm_evals_and_exports_its_contexts(lm_out, jex_export):
    theirs = lm_results(lm_out)["results"]["fid_wino"]
    ours = json.loads(next(jex_export.glob("results_*.json")).read_text())["results"]["fid_wino"]
    assert ours["acc,none"] == theirs["acc,none"] and "acc_norm,none" not in ours
    (path,) = jex_export.glob("samples_fid_wino_*.jsonl")
    exported = sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    for s, e in zip(lm_samples(lm_out, "fid_wino"), exported, strict=True):
        assert e["arguments"] == s["arguments"] and e["acc"] == s["acc"]


def test_clusters_and_the_report(jex_run):
    samples = pl.read_parquet(jex_run / "samples.parquet")
    by_topic = {json.loads(m)["doc_id"]: q for m, q, c in samples.select("metadata", "question_id", "catalog").rows()
                if c == "fid_text"}
    assert by_topic[1] == by_topic[2] == by_topic[5] == "fid_text-animals"  # --cluster topic
    report = (jex_run / "report.md").read_text()
    assert "is its own cluster" not in report  # the line a suite without --cluster gets
    (line,) = [ln for ln in report.splitlines() if ": lm-eval's own context, read verbatim, with no chat template " \
               "(lm-eval's default" in ln]
    assert all(f"`{task}`" in line.split(":")[0] for task in ALL_TASKS), line
