"""Sampled generations that reproduce bit for bit, repeats, pass@k and maj@k, thinking stripped (issue 57).

A generative catalog samples `samples` generations per row at a temperature, each seeded by a hash of (its
catalog's seed, the row's run_id, the sample's index); the HF engine draws each token from the row's own float32
logits with the request's own generator, so a row's samples are the same whatever the batch, the shards or the
engines that compute them. lm-eval's `repeats`, `take_first_k` and `majority_vote` read the samples as lm-eval
reads them, pass@k and maj@k are scoring kinds of the index, the legs and the clustered bootstrap, and a reasoning
model's thought is stripped before any filter reads its response (lm-eval's `think_end_token`).

The campaign here is small: three generative catalogs of three GSM8K-shaped rows each (examples/make_mixed_suite.py's
word problems), 3 or 4 samples of at most 20 tokens per row, in process."""

from __future__ import annotations

import json
import math
import sys
from fractions import Fraction
from itertools import combinations
from pathlib import Path

import polars as pl
import pytest
import yaml

from jex.answer_extraction import exact_match, extract, filter_from_config, response_after_thinking
from jex.errors import InputError
from jex.suite import Catalog, GenerationSettings, Thinking, load_manifest, sample_seed
from jex.tasks.scoring.verdicts import majority, pass_at_k
from tests.conftest import sc_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from make_mixed_suite import FLEXIBLE, STRICT, problem, prompt  # noqa: E402

GSM8K_TASKS = Path(__import__("importlib.util").util.find_spec("lm_eval").origin).parent / "tasks" / "gsm8k"
"""lm-eval's shipped GSM8K task YAMLs (found without importing lm-eval, which takes seconds)."""
UNTIL = ["Question:", "</s>", "<|im_end|>"]
ROWS = 3
VOTE = {"name": "maj@4", "steps": [*STRICT["steps"][:1], {"function": "majority_vote"}, {"function": "take_first"}]}
FIRST_TWO = {"name": "maj@2", "steps": [{"function": "take_first_k", "k": 2}, *VOTE["steps"]]}
CATALOGS = [
    {"id": "vote", "scoring": "exact_match", "filters": [{**STRICT, "name": "score-first"}, VOTE, FIRST_TWO],
     "generation": {"until": UNTIL, "max_tokens": 20, "temperature": 0.7, "samples": 4, "seed": 7}},
    {"id": "pass", "scoring": "pass_at_k", "k": 2, "filters": [FLEXIBLE],
     "generation": {"until": UNTIL, "max_tokens": 20, "temperature": 0.9, "top_p": 0.95, "top_k": 40,
                    "samples": 4}},
    {"id": "think", "scoring": "maj_at_k", "filters": [FLEXIBLE],  # the embedded model does not think: "####"
     "generation": {"until": UNTIL, "max_tokens": 14, "temperature": 0.7, "samples": 3,  # stands in for </think>
                    "thinking": {"end": "####"}}},
]


def sampled_suite(root: Path) -> Path:
    """Three generative catalogs (majority votes, pass@2, a thought) of `ROWS` word problems each."""
    import random

    from jex.fileio import write_toml

    (root / "rows").mkdir(parents=True)
    rng = random.Random("jex-sampled")
    problems = [problem(rng) for _ in range(ROWS)]
    for cat in CATALOGS:
        (root / "rows" / f"{cat['id']}.jsonl").write_text("".join(
            json.dumps({"run_id": f"{cat['id']}-{i}", "catalog": cat["id"], "question_id": f"q{i}",
                        "prompt": prompt(q), "answer": f"#### {a}"}) + "\n" for i, (q, a) in enumerate(problems)))
    catalogs = [{"name": c["id"], "leg": "public", "files": [f"rows/{c['id']}.jsonl"], "kind": "generate",
                 "prompt_format": "verbatim",
                 "match": {"regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"], "ignore_case": True}, **c}
                for c in CATALOGS]
    write_toml(root / "suite.toml", {"name": "sampled", "legs": {"public": 1.0}, "catalogs": catalogs})
    return root


# --- the settings, their seeds and their bytes --------------------------------------------------------

def test_a_greedy_generation_table_keeps_the_bytes_it_had_and_a_sampled_one_round_trips():
    greedy = GenerationSettings(until=("Q:",), max_tokens=8)
    assert greedy.model_dump(mode="json") == {"until": ["Q:"], "max_tokens": 8} and not greedy.sampled
    sampled = GenerationSettings(until=("Q:",), max_tokens=8, temperature=0.7, top_p=0.9, samples=4, seed=3,
                                 thinking=Thinking(end="</think>"))
    assert GenerationSettings.model_validate(sampled.model_dump(mode="json")) == sampled and sampled.sampled
    catalog = Catalog(id="g", name="g", leg="l", files=("g.jsonl",), kind="generate", scoring="exact_match",
                      prompt_format="verbatim", generation=greedy)
    assert "k" not in catalog.declared() and catalog.declared()["generation"] == {"until": ["Q:"], "max_tokens": 8}


def test_a_samples_seed_is_a_hash_of_the_catalogs_seed_the_run_id_and_the_index_alone():
    seed = sample_seed(7, "row-1", 2)
    assert seed == sample_seed(7, "row-1", 2) == 4584089850259128572 and 0 <= seed < 2**63  # pinned: samples depend
    others = {sample_seed(8, "row-1", 2), sample_seed(7, "row-2", 2), sample_seed(7, "row-1", 3)}  # on it
    assert seed not in others and len(others) == 3


@pytest.mark.parametrize(("generation", "extra", "words"), [
    ({"top_p": 0.9}, {}, "set a temperature"),
    ({"temperature": 0.7, "samples": 2}, {"scoring": "pass_at_k", "k": 3}, "k = 3, but the generation has 2"),
    ({"temperature": 0.7, "samples": 2}, {"filters": [FIRST_TWO | {"steps": [{"function": "take_first_k", "k": 4},
                                                                         {"function": "take_first"}]}]},
     "takes the first 4 responses"),
    ({}, {"k": 1}, "k is the k of pass_at_k and maj_at_k"),
])
def test_sampling_settings_that_cannot_hold_are_named_in_the_manifest(tmp_path, generation, extra, words):
    from jex.fileio import write_toml

    catalog = {"id": "g", "name": "g", "leg": "public", "files": ["g.jsonl"], "kind": "generate",
               "scoring": "exact_match", "prompt_format": "verbatim",
               "generation": {"until": UNTIL, "max_tokens": 8, **generation}, **extra}
    write_toml(tmp_path / "suite.toml", {"legs": {"public": 1.0}, "catalogs": [catalog]})
    with pytest.raises(InputError, match=words) as e:
        load_manifest(tmp_path)
    assert "suite.toml" in str(e.value)


# --- lm-eval's filters over a row's samples, its thought stripping, pass@k ---------------------------

def lm_eval_filtered(steps: list[dict], responses: list[str]) -> object:
    """The answer lm-eval's own filter classes extract from one document's responses (its `repeats`)."""
    import lm_eval.filters  # noqa: F401 - registers the filters
    from lm_eval.api.registry import get_filter

    resps: object = [list(responses)]
    for step in steps:
        kwargs = {k: v for k, v in step.items() if k != "function"}
        resps = list(get_filter(step["function"])(**kwargs).apply(resps, [{}]))
    (out,) = resps  # type: ignore[misc]
    return out


REPEATS = [
    ["The answer is 5.", "The answer is 6.", "The answer is 5.", "no answer", "The answer is 6.", "The answer is 6.",
     "The answer is 7.", "The answer is 5.", "The answer is 5."],
    ["The answer is 1,000.", "x", "The answer is 2.", "The answer is 2.", "y", "y", "y", "The answer is 1,000.", "z"],
    ["no", "numbers", "in", "these", "nine", "responses", "so", "all", "fall back"],
    ["The answer is 3.", "The answer is 4.", "The answer is 4.", "The answer is 3.", "The answer is -1.",
     "The answer is -1.", "The answer is 9.", "The answer is 9.", "The answer is 8."],  # ties: the first seen wins
]


@pytest.mark.parametrize("entry", yaml.safe_load((GSM8K_TASKS / "gsm8k-cot-self-consistency.yaml").read_text())[
    "filter_list"], ids=lambda e: e["name"])
def test_the_self_consistency_filters_read_a_rows_samples_as_lm_eval_reads_its_repeats(entry):
    ours = filter_from_config(entry["name"], entry["filter"])
    for responses in REPEATS:
        assert extract(ours, responses) == lm_eval_filtered(entry["filter"], responses), responses


@pytest.mark.parametrize("text", ["<think>2 + 2 is 4\n\nQuestion: no</think>  The answer is 4.\n\nQuestion: next",
                                  "<think>a</think>b</think>\n c Question: d", "never closed\n\nQuestion: x",
                                  "</think>", "<think>\n</think>\n\n"])
def test_the_response_after_the_thought_is_lm_evals(text):
    from lm_eval.models.utils import postprocess_generated_text

    assert response_after_thinking(text, "</think>", ["Question:", "\n\n"]) == \
        postprocess_generated_text(text, ["Question:", "\n\n"], "</think>")


def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_right_one():
    """The unbiased estimator against the readable count: of every k-subset of the n samples, those with a hit."""
    for n in range(1, 7):
        for c in range(n + 1):
            hits = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(combinations(range(n), k))
                expected = Fraction(sum(any(hits[i] for i in s) for s in subsets), len(subsets))
                assert pass_at_k(n, c, k) == float(expected), (n, c, k)


def test_the_sampler_reads_its_rows_logits_and_its_seed_alone():
    import torch

    from jex.engine.sampling import RowSampler
    from jex.engine.types import Sampling

    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))

    def draws(sampling: Sampling, row: torch.Tensor = logits) -> list[int]:
        sampler = RowSampler(sampling)
        return [sampler.pick(row) for _ in range(30)]

    assert draws(Sampling(1.0, seed=5)) == draws(Sampling(1.0, seed=5)) != draws(Sampling(1.0, seed=6))
    assert draws(Sampling(1.0, seed=5), logits.double()) == draws(Sampling(1.0, seed=5))  # read as float32
    assert set(draws(Sampling(2.0, seed=5, top_k=1))) == set(draws(Sampling(2.0, seed=5, top_p=1e-6))) == \
        {int(logits.argmax())}
    assert set(draws(Sampling(1.0, seed=5, top_k=3))) <= set(torch.topk(logits, 3).indices.tolist())


# --- scoring: pass@k and maj@k in the index, the legs and the bootstrap ------------------------------------

def test_pass_at_k_and_maj_at_k_are_scored_by_both_scorers_and_resampled_row_by_row(tmp_path):
    """Each row's samples reach the index as one number (its pass@k, or its majority's verdict), so the clustered
    bootstrap resamples rows (and questions) with their samples together."""
    from jex.tasks.bundle.suite_table import load_predictions, load_suite_table
    from jex.tasks.scoring.bootstrap_ci import ClusterLayout
    from jex.tasks.scoring.index import scored_frame
    from jex.tasks.scoring.score import score_with_ci

    suite = sampled_suite(tmp_path / "suite")
    passes = {"pass-0": 0.5, "pass-1": 1.0, "pass-2": None}  # the last: not generated, unsupported (0)
    preds = [{"run_id": f"{c}-{i}", "exact_match": i != 1} for c in ("vote", "think") for i in range(ROWS)]
    preds += [{"run_id": rid, "exact_match": v == 1.0, "pass_at_k": v} for rid, v in passes.items()]
    (tmp_path / "preds.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preds))
    table = load_suite_table(suite)
    predictions = load_predictions(tmp_path / "preds.jsonl", table.rows)
    doc = score_with_ci(table.rows, predictions, table.spec, draws=200, seed=1)  # both scorers agree, or it raises
    p, m = doc.catalogs["pass"], doc.catalogs["think"]
    assert (p.kind, p.value, p.correct, p.unsupported, p.chance) == ("pass_at_k", 0.5, 1, 1, 0.0)
    assert (m.kind, m.value, m.correct, m.unsupported) == ("maj_at_k", 2 / 3, 2, 0)
    assert p.ci[0] <= p.skill <= p.ci[1] and doc.full == 100 * math.fsum([2 / 3, 0.5, 2 / 3]) / 3
    frame = scored_frame(table.rows, predictions, table.spec)
    sums = ClusterLayout.from_frame(frame, table.spec).per_cluster_values(frame, table.spec)
    assert list(sums[1]) == [0.5, 1.0, 0.0]  # catalog `pass`: question q0, q1, q2 each its row's pass@2


def test_lm_evals_shipped_self_consistency_task_is_one_jex_reproduces():
    """gsm8k_cot_self_consistency's own fields (its YAML over gsm8k-cot's, as lm-eval's `include` merges them)."""
    from jex.lm_eval_scoring import GenerativeScoring, generative_scoring

    config = {**yaml.safe_load((GSM8K_TASKS / "gsm8k-cot.yaml").read_text()),
              **yaml.safe_load((GSM8K_TASKS / "gsm8k-cot-self-consistency.yaml").read_text())}
    scoring = generative_scoring("gsm8k_cot_self_consistency", config, config["generation_kwargs"])
    assert isinstance(scoring, GenerativeScoring)
    assert (scoring.samples, scoring.temperature, scoring.until) == (64, 0.2, ("Q:", "\n\n"))
    assert [f.name for f in scoring.filters] == ["score-first", "maj@64", "maj@8"]


def test_a_self_consistency_task_imports_with_its_repeats_sampling_and_votes(tmp_path):
    from typer.testing import CliRunner

    from jex.cli import app

    task = sc_task(tmp_path / "task", repeats=4, sampling="  do_sample: true\n  temperature: 0.2\n  top_p: 0.95\n")
    out = CliRunner().invoke(app, ["suite", "import", "lm-eval", "--task", str(task), "-o", str(tmp_path / "s")])
    assert out.exit_code == 0, out.output
    catalog = load_manifest(tmp_path / "s").catalog("sc_gsm")
    assert catalog.generation is not None and catalog.scoring == "exact_match"
    g = catalog.generation
    assert (g.samples, g.temperature, g.top_p, g.top_k, g.max_tokens) == (4, 0.2, 0.95, 0, 32)
    assert [f.name for f in catalog.filters] == ["score-first", "maj@4", "maj@2"]
    assert [s.function for s in catalog.filters[2].steps] == ["take_first_k", "regex", "majority_vote", "take_first"]


# --- the HF engine: each request's samples its own --------------------------------------------------------

@pytest.fixture(scope="module")
def engine(embedded_model_dir):
    """The process's engine of the default spec (the campaign below computes with it too: loaded once)."""
    from jex.engine_spec import EngineSpec
    from jex.tasks.execution.engine_pool import get_engine

    return get_engine(EngineSpec())


def test_a_sampled_requests_logits_and_tokens_are_its_own_in_any_batch(engine, monkeypatch):
    """Lock-step decoding gives each row the same float32 logits, bit for bit, alone or among others (greedy
    ones included) and in any order, so its seeded draws are the same tokens."""
    import hashlib

    from jex.engine.sampling import RowSampler
    from jex.engine.types import GenerateRequest, Sampling

    seen: dict[tuple[int, int], list[str]] = {}
    pick = RowSampler.pick

    def recording(self: RowSampler, logits):  # the bits each row's draw reads, by (seed, draw)
        seen.setdefault((self.sampling.seed, self._draws), []).append(
            hashlib.sha256(logits.float().numpy().tobytes()).hexdigest())
        self._draws += 1
        return pick(self, logits)

    monkeypatch.setattr(RowSampler, "pick", recording)
    monkeypatch.setattr(RowSampler, "_draws", 0, raising=False)
    prompts = [prompt(problem(__import__("random").Random(i))[0]) for i in range(2)]
    requests = [GenerateRequest(f"r{i}", p, 6, sampling=Sampling(1.5, seed=10 * i + k) if k else None)
                for i, p in enumerate(prompts) for k in range(3)]
    together = engine.generate(requests)
    alone = [engine.generate([r])[0] for r in reversed(requests)][::-1]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert len(seen) >= 4 and all(len(set(bits)) == 1 and len(bits) == 2 for bits in seen.values())
    assert {g.token_ids for g in together[:3]} != {together[0].token_ids}  # sampled, not the greedy continuation


def test_model_generate_samples_each_row_by_its_own_seed_too(engine, monkeypatch):
    """Off the lock-step path (a GPU, one request per `model.generate`), the same per-request draw."""
    from jex.engine.types import GenerateRequest, Sampling

    monkeypatch.setattr(engine, "_lockstep_model", False)
    requests = [GenerateRequest("a", "The capital of France is", 6, sampling=Sampling(1.2, seed=s)) for s in (1, 2)]
    first, again = engine.generate(requests), engine.generate(requests)
    assert [g.token_ids for g in first] == [g.token_ids for g in again] and first[0].text != first[1].text


def test_the_vllm_engine_sends_each_sampled_request_its_own_seed_in_one_call():
    """vLLM's `SamplingParams(seed=...)` per request (its generator of the request's own), greedy requests as
    before; here against a stand-in for `LLM.generate` (vLLM needs CUDA), which records what it is sent."""
    from types import SimpleNamespace

    from jex.engine.types import GenerateRequest, Sampling
    from jex.engine.vllm_engine import VLLMEngine

    sent: list[tuple[int, object]] = []

    def generate(prompts, params, use_tqdm):
        sent.append((len(prompts), params))
        return [SimpleNamespace(outputs=[SimpleNamespace(text=" 4", token_ids=[7], finish_reason="stop")])
                for _ in prompts]

    engine = object.__new__(VLLMEngine)
    engine.SamplingParams, engine.llm = dict, SimpleNamespace(generate=generate)  # params as the dict of kwargs
    engine.max_context, engine.batch_size, engine.calls = 100, 0, {"generate": 0}
    requests = [GenerateRequest("a", "2 + 2 =", 4, ("Q:",), prompt_ids=(1, 2)),
                *(GenerateRequest("b", "2 + 2 =", 4, ("Q:",), prompt_ids=(1, 2),
                                  sampling=Sampling(0.7, seed=sample_seed(0, "b", k), top_p=0.9)) for k in range(2))]
    assert [g.text for g in engine.generate(requests)] == [" 4"] * 3
    (greedy, params), (sampled, per_request) = sent
    assert greedy == 1 and params["temperature"] == 0 and "seed" not in params
    assert sampled == 2 and [(p["seed"], p["temperature"], p["top_p"], p["top_k"], p["stop"])
                             for p in per_request] == [(sample_seed(0, "b", k), 0.7, 0.9, 0, ["Q:"]) for k in range(2)]


# --- a sampled campaign -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory, prefect_harness):
    from jex.flows.campaign import run_campaign
    from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec

    root = tmp_path_factory.mktemp("sampled")
    suite = sampled_suite(root / "suite")
    with pytest.MonkeyPatch.context() as env:  # no JEX_* setting or .env of the person running the tests
        env.chdir(root)
        for name in [n for n in __import__("os").environ if n.startswith("JEX_")]:
            env.delenv(name)
        env.setenv("JEX_INFRA__STATE_DIR", str(root / "infra"))
        out = run_campaign(CampaignSpec(name="sampled", suite=str(suite), bootstrap_draws=200,
                                        store=str(root / "store"), out=str(root / "runs"),
                                        machines=MachinesSpec(provider="inprocess")))
    return {"run": out, "root": root, "suite": suite}


def samples_of(run: Path) -> dict[str, dict]:
    return {r["run_id"]: r for r in pl.read_parquet(run / "samples.parquet").iter_rows(named=True)}


def test_every_sample_is_recorded_and_the_filters_read_them_all_as_lm_evals_repeats(run):
    manifest = load_manifest(run["suite"])
    rows = samples_of(run["run"]).values()
    assert sum(len(set(r["sample_generations"])) > 1 for r in rows) > ROWS  # sampled: most rows' samples differ
    for r in rows:
        catalog = manifest.catalog(r["catalog"])
        assert catalog.generation is not None
        n = catalog.generation.samples
        assert r["samples"] == n == len(r["sample_generations"]) == len(r["sample_answers"])
        assert r["generation"] == r["sample_generations"][0]
        assert r["answers"] == [extract(f, r["sample_responses"]) for f in catalog.answer_filters()]
        assert r["sample_answers"] == [extract(catalog.answer_filters()[0], s) for s in r["sample_responses"]]


def test_pass_at_k_and_maj_at_k_are_the_index_kinds_of_their_catalogs(run):
    rows = samples_of(run["run"])
    score = json.loads((run["run"] / "score.json").read_text())["catalogs"]
    passes = [pass_at_k(4, sum(rows[f"pass-{i}"]["sample_verdicts"]), 2) for i in range(ROWS)]
    assert [rows[f"pass-{i}"]["pass_at_k"] for i in range(ROWS)] == passes
    assert score["pass"]["kind"] == "pass_at_k" and score["pass"]["value"] == math.fsum(passes) / ROWS
    think = [rows[f"think-{i}"] for i in range(ROWS)]
    match = load_manifest(run["suite"]).catalog("think").match
    assert [r["exact_match"] for r in think] == [exact_match(majority(r["sample_answers"]), r["reference"], match)
                                                 for r in think]
    assert score["think"]["kind"] == "maj_at_k" and score["think"]["correct"] == sum(r["exact_match"] for r in think)
    assert score["vote"]["kind"] == "exact_match" and all(s["ci"][0] <= s["skill"] <= s["ci"][1]
                                                          for s in score.values())


def test_the_thought_is_stripped_counted_and_an_unclosed_one_shown(run):
    from typer.testing import CliRunner

    from jex.cli import app

    rows = [r for r in samples_of(run["run"]).values() if r["catalog"] == "think"]
    closed = [c for r in rows for c in r["thought_closed"]]
    for r in rows:
        for text, response in zip(r["sample_generations"], r["sample_responses"], strict=True):
            assert response == response_after_thinking(text, "####", UNTIL)
    from jex.run_records import RunStages
    from jex.tasks.records import GenerateSummary
    from jex.tasks.store import LocalStore

    key = RunStages.read(run["run"]).root["generate"].key
    summary = LocalStore(run["root"] / "store").stage("generate", key).read(GenerateSummary)
    assert summary.thinking is not None and summary.samples == 4 * ROWS + 4 * ROWS + 3 * ROWS
    assert summary.thinking.generations == len(closed) == 9 and summary.thinking.unclosed == closed.count(False)
    assert "never closed" in (run["run"] / "report.md").read_text()
    out = CliRunner().invoke(app, ["show", str(run["run"]), "--catalog", "think"])
    assert out.exit_code == 0, out.output
    assert out.output.count("sample 2,") == ROWS and ("NEVER CLOSED" in out.output) == (False in closed)


def test_the_exports_carry_every_sample(run, tmp_path):
    from inspect_ai.log import read_eval_log
    from typer.testing import CliRunner

    from jex.cli import app
    from jex.tasks.outputs.interop.inspect_log import export_inspect

    rows = samples_of(run["run"])
    out = CliRunner().invoke(app, ["export", "lm-eval", str(run["run"]), "-o", str(tmp_path / "lm")])
    assert out.exit_code == 0, out.output
    (vote,) = (tmp_path / "lm").rglob("samples_vote_*.jsonl")
    lines = [json.loads(x) for x in vote.read_text().splitlines()]
    assert len(lines) == 3 * ROWS and all(ln["resps"] == [rows[ln["doc"]["run_id"]]["sample_responses"]]
                                          for ln in lines)
    (results,) = (tmp_path / "lm").rglob("results_*.json")
    doc = json.loads(results.read_text())
    assert doc["configs"]["vote"]["repeats"] == 4 and doc["configs"]["vote"]["generation_kwargs"]["do_sample"]
    assert set(doc["results"]["vote"]) >= {"exact_match,score-first", "exact_match,maj@4", "exact_match,maj@2"}
    log = read_eval_log(str(export_inspect(run["run"], tmp_path / "inspect")))
    by_id = {s.id: s for s in log.samples or []}
    assert all([c.message.text for c in by_id[rid].output.choices] == r["sample_generations"]
               for rid, r in rows.items())


def test_the_same_sampled_campaign_is_the_same_bytes_whatever_the_batch_shards_and_engines(run, tmp_path):
    """The generate stage again, two rows per shard (8 requests per engine call, not all 33 in one), by two workers,
    the second with a fresh engine: the key and the bytes of the campaign's own."""
    from jex.engine_spec import EngineSpec
    from jex.run_records import RunStages
    from jex.tasks.capture.stages import ShardShare, generate_stage
    from jex.tasks.execution.engine_pool import release_engine
    from jex.tasks.inputs import GenerateInputs
    from jex.tasks.records import BundleSummary, GenerateSummary, PartialSummary
    from jex.tasks.store import LocalStore

    stages = RunStages.read(run["run"]).root
    campaign = LocalStore(run["root"] / "store")
    bundle = campaign.stage("bundle", stages["bundle"].key).read(BundleSummary)
    done = campaign.stage("generate", stages["generate"].key).read(GenerateSummary)
    spec = EngineSpec()  # the campaign's: worker 0 computes with the engine the campaign used
    inputs = GenerateInputs(bundle=bundle, engine=spec, shard_rows=2)
    store = LocalStore(tmp_path / "store")
    part = generate_stage.run(store, inputs, share=ShardShare(worker=0, workers=2))
    assert isinstance(part, PartialSummary)
    release_engine(spec)  # worker 1's engine is another one
    generate_stage.run(store, inputs, share=ShardShare(worker=1, workers=2))
    again = generate_stage(store, inputs)
    assert (done.shards, again.shards) == (1, 5) and (again.key, again.sha256) == (done.key, done.sha256)
