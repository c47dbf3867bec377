"""lm-eval fidelity, part A: verbatim prompts, the continuation readout as lm-eval's `loglikelihood`
computes it (checked against lm-eval's own HF backend on the embedded model), `acc_norm`, and a
loglikelihood catalog through the stages into the samples record."""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl
import pytest

from jex.engine.types import ReadoutMode, ReadoutRequest
from jex.engine_spec import RenderSpec
from jex.numerics import length_normalised_choice
from jex.tasks.capture.engine_calls import CaptureRow, CatalogRead, question_prompts
from tests.conftest import row

pytestmark = pytest.mark.slow

VERBATIM = CatalogRead("loglikelihood", "verbatim", " ")
MMLU_PROMPT = ("The following are multiple choice questions (with answers) about colours.\n\n"
               "What colour is the sky on a clear day?\nA. green\nB. blue\nC. red\nD. black\nAnswer:")


@pytest.fixture(scope="module")
def engine():
    from jex.engine.hf import HFEngine

    return HFEngine()


def _rows() -> list[CaptureRow]:
    return [CaptureRow("v1", MMLU_PROMPT, ("A", "B", "C", "D"), ("A", "B", "C", "D"), 1, "ll", "q1"),
            CaptureRow("t1", "What is 2 + 2?", ("A", "B"), ("4", "5"), 0, "mc", "q2")]


def test_a_verbatim_prompt_is_read_as_it_stands_and_auto_means_no_chat_template(engine):
    reads = {"ll": VERBATIM}
    verbatim, templated = question_prompts(engine, _rows(), RenderSpec(), reads=reads)
    assert verbatim.prompt == MMLU_PROMPT and verbatim.delimiter == " "
    assert templated.prompt.startswith("<|im_start|>") and templated.prompt.endswith("Answer:")
    asked = question_prompts(engine, _rows()[:1], RenderSpec(chat_template="model"), reads=reads)[0]
    assert asked.prompt == engine.chat_prompt(MMLU_PROMPT)
    assert question_prompts(engine, _rows()[:1], RenderSpec(chat_template="none"), reads=reads)[0].prompt == MMLU_PROMPT
    tab = question_prompts(engine, _rows()[:1], RenderSpec(), reads={"ll": CatalogRead("label_slot", "verbatim", "\t")})
    assert tab[0].prompt == MMLU_PROMPT and tab[0].delimiter == "\t"


def test_a_question_template_may_leave_the_options_out_and_default_digests_stay():
    spec = RenderSpec(question_template="{prompt}\nAnswer with the letter.")
    assert "{options}" not in spec.question_template
    with pytest.raises(ValueError, match="placeholders"):
        RenderSpec(question_template="{prompt} {extra}")
    with pytest.raises(ValueError, match="placeholders"):
        RenderSpec(reason_template="{prompt} only")
    # the default digest, pinned: every existing engine stage key depends on it
    assert RenderSpec().digest()["sha256"] == _PINNED_DEFAULT_DIGEST


_PINNED_DEFAULT_DIGEST = "cbb27bc81f784be12e1855cd7898ba52fa1d13f6a73c39bcfbf58c5108f9464d"


PAIRS = [("Question: What colour is the sky?\nAnswer:", ("blue", "green", "a deep shade of red")),
         ("The capital of France is ", ("Paris", "Lyon")),  # trailing space moves to the continuation
         ("", ("Hello there", "world")),  # empty context: the prefix token
         (MMLU_PROMPT, ("A", "B", "C", "D"))]


def test_the_continuation_readout_is_lm_evals_loglikelihood(engine):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    requests = [ReadoutRequest(f"r{i}", ctx, tuple("ABCD"[:len(opts)]), opts) for i, (ctx, opts) in enumerate(PAIRS)]
    got = engine.readout(requests, ReadoutMode.OPTION_CONTINUATION)
    lm = HFLM(pretrained=str(engine.path), device="cpu", batch_size=1, softmax_dtype="float64")
    want = lm.loglikelihood([Instance("multiple_choice", {}, (ctx, " " + o), 0) for ctx, opts in PAIRS for o in opts],
                            disable_tqdm=True)
    flat = [(ll, greedy) for r in got for ll, greedy in zip(r.raw_logprobs, r.greedy, strict=True)]
    assert [g for _, g in flat] == [g for _, g in want]
    assert max(abs(a - b) for (a, _), (b, _) in zip(flat, want, strict=True)) < 1e-5
    assert all(r.refusal is None and r.label_mass is None for r in got)
    assert math.fsum(math.exp(x) for x in got[0].logprobs) == pytest.approx(1.0, abs=1e-12)


def test_one_token_options_give_the_label_slots_numbers_exactly(engine):
    req = ReadoutRequest("v1", MMLU_PROMPT, ("A", "B", "C", "D"), ("A", "B", "C", "D"))
    slot = engine.readout([req], ReadoutMode.LABEL_SLOT)[0]
    cont = engine.readout([req], ReadoutMode.OPTION_CONTINUATION)[0]
    assert cont.raw_logprobs == slot.raw_logprobs and cont.logprobs == slot.logprobs
    assert sum(cont.greedy) <= 1


def test_left_truncation_keeps_the_last_window_of_tokens(engine):
    plan = engine.plan_continuation([ReadoutRequest("x", "word " * 50, ("A", "B"), ("one", "two three"))])[1][0]
    small = type(plan)(plan.index, plan.contexts, plan.continuations, window=8)
    assert small.sequence(1) == list(plan.contexts[1] + plan.continuations[1])[-8:]
    assert plan.window == engine.max_context + 1


def test_acc_norm_divides_by_characters_and_ties_go_first():
    assert length_normalised_choice([-4.0, -6.0], ["ab", "abcdef"]) == 1  # -2.0 vs -1.0
    assert length_normalised_choice([-4.0, -4.0], ["ab", "ab"]) == 0
    assert length_normalised_choice([-3.0, -3.5], ["é", "ab"]) == 1  # one character, two bytes: characters count


def test_the_scorers_score_acc_norm_and_report_it_beside_acc(tmp_path):
    from jex.tasks.bundle.suite_table import CatalogSpec, ScoreSpec, load_predictions
    from jex.tasks.scoring.score import score_with_ci

    rows = pl.DataFrame({"run_id": ["a", "b", "c", "d"], "catalog": ["ll"] * 4, "question_id": ["a", "b", "c", "d"],
                         "gold": [0, 1, 0, 1], "n_options": [2] * 4},
                        schema={"run_id": pl.String, "catalog": pl.String, "question_id": pl.String,
                                "gold": pl.Int32, "n_options": pl.Int32})
    path = tmp_path / "preds.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in [
        {"run_id": "a", "choice": 0, "acc_norm_choice": 0}, {"run_id": "b", "choice": 0, "acc_norm_choice": 1},
        {"run_id": "c", "choice": 1, "acc_norm_choice": 0}, {"run_id": "d", "choice": 1}]) + "\n")
    preds = load_predictions(path, rows)
    spec = ScoreSpec({"public": 1.0}, (CatalogSpec("ll", "public", 1.0, None, scoring="acc_norm",
                                                   readout="loglikelihood"),))
    doc = score_with_ci(rows, preds, spec, draws=20, seed=1)
    cat = doc.catalogs["ll"]
    assert (cat.acc, cat.acc_norm, cat.value, cat.unsupported) == (0.5, 0.75, 0.75, 1)
    assert cat.skill == pytest.approx((0.75 - 0.5) / 0.5)
    as_acc = score_with_ci(rows, preds, ScoreSpec({"public": 1.0}, (CatalogSpec("ll", "public", 1.0, None),)),
                           draws=20, seed=1)
    assert "acc_norm" not in as_acc.model_dump(mode="json")["catalogs"]["ll"]


def _suite(root: Path) -> Path:
    (root / "rows").mkdir(parents=True)
    ll = [{"run_id": f"ll-{i}", "catalog": "ll", "question_id": f"ll-{i}",
           "prompt": f"Question: Which word names a colour? (#{i})\nAnswer:",
           "options": ["red", "a table made of oak wood", "running"], "labels": ["A", "B", "C"], "gold": 0}
          for i in range(4)]
    mc = [row(f"mc-{i}", "mc", k=3, gold=i % 3) for i in range(4)]
    for name, rows in (("ll", ll), ("mc", mc)):
        (root / "rows" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "suite.toml").write_text(
        '[legs]\npublic = 1.0\n\n[[catalogs]]\nid = "ll"\nname = "ll"\nleg = "public"\nfiles = ["rows/ll.jsonl"]\n'
        'readout = "loglikelihood"\nprompt_format = "verbatim"\nscoring = "acc_norm"\n\n'
        '[[catalogs]]\nid = "mc"\nname = "mc"\nleg = "public"\nfiles = ["rows/mc.jsonl"]\n')
    return root


def test_a_loglikelihood_catalog_through_the_stages_into_the_samples_record(tmp_path):
    from jex.engine_spec import EngineSpec
    from jex.tasks.bundle.reading import bundle_rows
    from jex.tasks.capture.stages import bundle_stage, fast_pass_stage, reason_stage
    from jex.tasks.decision_stages import calibrate_stage, fold_stage, gate_stage, overlay_stage, score_stage
    from jex.tasks.outputs.samples import RenderedPrompts, build_samples
    from jex.tasks.store import LocalStore

    store, engine = LocalStore(tmp_path / "store"), EngineSpec()
    bundle = bundle_stage(store, suite=_suite(tmp_path / "suite"))
    fast = fast_pass_stage(store, bundle=bundle, engine=engine, shard_rows=3)
    capture = pl.read_parquet(fast.capture)
    assert (fast.key_fallbacks, fast.readout_errors, fast.context_refusals) == (0, 0, 0)
    ll = capture.filter(pl.col("run_id").str.starts_with("ll"))
    assert ll["label_mass"].null_count() == 4 and ll["refusal"].null_count() == 4
    assert all(len(x) == 3 for x in ll["choice_loglikelihoods"].to_list())
    assert capture.filter(pl.col("run_id").str.starts_with("mc"))["choice_loglikelihoods"].null_count() == 4
    gate = gate_stage(store, bundle=bundle, fast=fast, coverage=1.0)
    gated = set(pl.read_parquet(gate.gated)["run_id"].to_list())
    assert gate.panel_rows == 4 and gated == {f"mc-{i}" for i in range(4)}  # the loglikelihood rows: never
    reason = reason_stage(store, bundle=bundle, gate=gate, engine=engine, max_tokens=2, shard_rows=4)
    fold = fold_stage(store, bundle=bundle, fast=fast, gate=gate, reason=reason, rule="mix", weight=0.5, draws=10,
                      seed=1)
    calibrated = calibrate_stage(store, bundle=bundle, fold=fold, folds=2)
    overlay = overlay_stage(store, calibrated=calibrated)
    score = json.loads(Path(score_stage(store, bundle=bundle, overlay=overlay, fold=fold, draws=10,
                                        seed=1).score_json).read_text())
    lm = score["catalogs"]["ll"]
    norm = ll["acc_norm_choice"].to_list()
    assert lm["kind"] == "acc_norm" and lm["value"] == sum(c == 0 for c in norm) / 4 == lm["acc_norm"]
    assert "acc_norm" not in score["catalogs"]["mc"]
    samples = build_samples(bundle_rows(bundle, store), capture=capture, gated=pl.read_parquet(gate.gated),
                            reasoned=pl.read_parquet(reason.reasoned), folded=pl.read_parquet(fold.folded),
                            predictions=pl.read_parquet(overlay.predictions), prompts=RenderedPrompts({}, {}),
                            excluded=set())
    got = samples.filter(pl.col("catalog") == "ll")
    assert got["choice_loglikelihoods"].to_list() == ll["choice_loglikelihoods"].to_list()
    assert got["acc_norm_correct"].to_list() == [c == 0 for c in norm]
    assert got["gated"].to_list() == [False] * 4


def test_the_vllm_continuation_reads_prompt_logprobs_and_the_label_slots_call(engine):
    """vLLM cannot run here: its readout code runs against a stand-in for `LLM.generate`'s outputs."""
    from types import SimpleNamespace as NS

    from jex.engine.vllm_engine import VLLMEngine

    eng = object.__new__(VLLMEngine)
    eng.tokenizer, eng.max_context, eng.has_token_ids_api = engine.tokenizer, 4096, True
    eng.SamplingParams, eng.calls = (lambda **kw: kw), {"readout": 0}
    calls: list[tuple[list[list[int]], dict]] = []

    def run(prompts, params):
        calls.append((prompts, params))
        if "prompt_logprobs" in params:  # rank 1 everywhere but the last token of the second option
            return [NS(prompt_logprobs=[None] + [{t: NS(logprob=-0.25, rank=2 if (i == len(p) - 1 and k == 1)
                                                                  else 1)} for i, t in enumerate(p) if i]) for k, p in
                    enumerate(prompts)]
        toks = params["logprob_token_ids"]
        return [NS(outputs=[NS(logprobs=[{t: NS(logprob=-1.0 - k) for k, t in enumerate(toks)}],
                               token_ids=[toks[1]])]) for _ in prompts]

    eng._run = run
    multi, single = eng.readout([ReadoutRequest("m", "The capital of France is", ("A", "B"), ("Paris", "big Lyon")),
                                 ReadoutRequest("s", MMLU_PROMPT, ("A", "B"), ("A", "B"))],
                                ReadoutMode.OPTION_CONTINUATION)
    plan = engine.plan_continuation([ReadoutRequest("m", "The capital of France is", ("A", "B"),
                                                    ("Paris", "big Lyon"))])[1][0]
    (shared, p1), (full, p2) = calls
    assert p1["logprob_token_ids"] == [engine.label_token("A"), engine.label_token("B")]
    assert shared == [engine.encode(MMLU_PROMPT)] and single.raw_logprobs == (-1.0, -2.0)
    assert single.greedy == (False, True)
    assert full == [list(ctx + c) for ctx, c in zip(plan.contexts, plan.continuations, strict=True)]
    assert p2["prompt_logprobs"] == 0
    assert multi.raw_logprobs == tuple(-0.25 * len(c) for c in plan.continuations) and multi.greedy == (True, False)
