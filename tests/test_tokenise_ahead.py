"""Rendering and tokenisation off the engine's critical path: a thread beside the engine prepares the next
shard (`run_sharded`'s `prepare_chunk`, the engine's `preparer()`) while the engine reads the current one,
and the stages' outputs keep their bytes (`JEX_PREPARE_AHEAD=0` prepares on the engine's thread)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
import time
from pathlib import Path

import polars as pl
import pytest

from jex.tasks.store import run_sharded

ITEMS = [f"r{i:02d}" for i in range(10)]  # shards of 3: r00-r02, r03-r05, r06-r08, r09


def frame(chunk) -> pl.DataFrame:
    return pl.DataFrame({"item": list(chunk)}, schema={"item": pl.String})


# --- run_sharded ------------------------------------------------------------------------------------

def test_the_next_shard_is_prepared_on_another_thread_while_the_current_one_computes(tmp_path):
    prepared_on: dict[str, str] = {}
    begun = {item: threading.Event() for item in ITEMS[::3]}
    overlapped = []

    def prepare_chunk(chunk):
        prepared_on[chunk[0]] = threading.current_thread().name
        begun[chunk[0]].set()
        return [x.upper() for x in chunk]

    def compute(prepared):
        following = ITEMS.index(prepared[0].lower()) + 3
        if following < len(ITEMS):
            overlapped.append(begun[ITEMS[following]].wait(timeout=10))
        return frame(prepared)

    stats = run_sharded(ITEMS, shard_rows=3, folder=tmp_path, compute=compute, prepare_chunk=prepare_chunk)
    assert stats.computed == [0, 1, 2, 3] and overlapped == [True, True, True]
    assert threading.current_thread().name not in prepared_on.values()
    assert pl.read_parquet(tmp_path / "shard-00001.parquet")["item"].to_list() == ["R03", "R04", "R05"]


@pytest.mark.parametrize("ahead", [False, True])
def test_a_preparation_error_fails_its_shard_after_the_shards_before_it_are_written(tmp_path, ahead):
    computed = []

    def prepare_chunk(chunk):
        if "r06" in chunk:
            raise ValueError("cannot render r06")
        return chunk

    def compute(chunk):
        computed.append(chunk[0])
        return frame(chunk)

    with pytest.raises(ValueError, match="cannot render r06"):
        run_sharded(ITEMS, shard_rows=3, folder=tmp_path, compute=compute, claim=True, prepare_chunk=prepare_chunk,
                    prepare_ahead=ahead)
    assert computed == ["r00", "r03"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".shard-00000.claim", ".shard-00001.claim", ".shard-00002.claim", "shard-00000.parquet", "shard-00001.parquet"]


@pytest.mark.parametrize("ahead", [False, True])
def test_a_failing_shard_leaves_no_claim_on_the_shard_prepared_after_it(tmp_path, ahead):
    def compute(chunk):
        if "r03" in chunk:
            raise RuntimeError("engine lost")
        return frame(chunk)

    with pytest.raises(RuntimeError, match="engine lost"):
        run_sharded(ITEMS, shard_rows=3, folder=tmp_path, compute=compute, claim=True, prepare_chunk=list,
                    prepare_ahead=ahead)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".shard-00000.claim", ".shard-00001.claim",
                                                          "shard-00000.parquet"]


def _share_shards(folder: Path, log: Path, start, end) -> None:
    """One of two processes computing the same shards with claims (shards prepared ahead)."""
    def compute(chunk):
        time.sleep(0.05)
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {chunk[0]}\n")
        return frame(chunk)

    start.wait()
    run_sharded([f"r{i:02d}" for i in range(12)], shard_rows=1, folder=folder, compute=compute, claim=True,
                prepare_chunk=list)
    end.wait()  # neither exits while the other still claims: a dead process's claim may be taken over


def test_two_processes_sharing_a_folder_compute_each_shard_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    start, end = ctx.Barrier(2), ctx.Barrier(2)
    log = tmp_path / "computed.log"
    procs = [ctx.Process(target=_share_shards, args=(tmp_path / "shards", log, start, end)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    computed = [line.split() for line in log.read_text().splitlines()]
    assert sorted(item for _, item in computed) == [f"r{i:02d}" for i in range(12)]  # each shard once
    assert len({pid for pid, _ in computed}) == 2  # and both took some
    assert len(list((tmp_path / "shards").glob("shard-*.parquet"))) == 12


# --- the engine and the stages (the embedded model) -------------------------------------------------

@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    from jex.sample_suite import write_sample_suite

    return write_sample_suite(tmp_path_factory.mktemp("tokenise-ahead") / "suite", rows=18, seed=0)


@pytest.fixture(scope="module")
def engine():
    """The engine the stages use in this process."""
    from jex.engine_spec import EngineSpec
    from jex.tasks.execution.engine_pool import get_engine

    return get_engine(EngineSpec())


@pytest.fixture(scope="module")
def rows(suite):
    from jex.suite import iter_rows

    return list(iter_rows(suite))


def fast_pass_in(root: Path, suite: Path, monkeypatch, *, ahead: bool):
    from jex.engine_spec import EngineSpec
    from jex.tasks.capture.stages import PREPARE_AHEAD_ENV, bundle_stage, fast_pass_stage
    from jex.tasks.store import LocalStore

    monkeypatch.setenv(PREPARE_AHEAD_ENV, "1" if ahead else "0")
    store = LocalStore(root)
    bundle = bundle_stage(store, suite=suite)
    return bundle, fast_pass_stage(store, bundle=bundle, engine=EngineSpec(), shard_rows=6)


@pytest.mark.slow
def test_prepared_requests_carry_the_ids_the_engine_gives_their_prompts(engine, rows):
    from jex.tasks.capture.engine_calls import prepared_questions, prepared_reasons, question_prompts, reason_prompts

    preparer = engine.preparer()
    assert preparer.tokenizer is not engine.tokenizer
    questions = prepared_questions(preparer, rows)
    assert [dataclasses.replace(q, prompt_ids=None) for q in questions] == question_prompts(engine, rows)
    assert [list(q.prompt_ids) for q in questions] == engine.encode_many([q.prompt for q in questions])
    calls = prepared_reasons(preparer, rows, max_tokens=8)
    assert [c.request.prompt for c in calls] == reason_prompts(engine, rows)
    assert [list(c.request.prompt_ids) for c in calls] == engine.encode_many(reason_prompts(engine, rows))


@pytest.mark.slow
def test_the_engine_reads_the_ids_a_request_carries_and_tokenises_only_the_rest(engine, monkeypatch):
    from jex.engine.types import ReadoutRequest

    real = engine.encode_many
    tokenised = []
    monkeypatch.setattr(engine, "encode_many", lambda texts: tokenised.append(list(texts)) or real(texts))
    carried = ReadoutRequest("a", "Question a?", ("A", "B"), prompt_ids=(1, 2, 3))
    plain = ReadoutRequest("b", "Question b?", ("A", "B"))
    assert engine.encode_prompts([carried, plain]) == [[1, 2, 3], real(["Question b?"])[0]]
    assert tokenised == [["Question b?"]]


@pytest.mark.slow
def test_the_fast_pass_capture_has_the_same_bytes_with_and_without_preparing_ahead(engine, suite, tmp_path,
                                                                                    monkeypatch):
    _, ahead = fast_pass_in(tmp_path / "ahead", suite, monkeypatch, ahead=True)
    _, inline = fast_pass_in(tmp_path / "inline", suite, monkeypatch, ahead=False)
    assert ahead.shards == 3 and ahead.sha256 == inline.sha256
    assert Path(ahead.capture).read_bytes() == Path(inline.capture).read_bytes()


@pytest.mark.slow
def test_preparing_ahead_the_engine_thread_tokenises_no_prompt(engine, suite, tmp_path, monkeypatch):
    from jex.engine.base import ChatTokenizer

    tokenised_on = []
    real = ChatTokenizer.encode_many

    def recording(self, texts):
        if texts:
            tokenised_on.append(threading.current_thread().name)
        return real(self, texts)

    monkeypatch.setattr(ChatTokenizer, "encode_many", recording)
    _, fast = fast_pass_in(tmp_path, suite, monkeypatch, ahead=True)
    assert len(tokenised_on) == fast.shards and threading.current_thread().name not in tokenised_on


@pytest.mark.slow
def test_a_prompt_too_long_for_the_context_is_the_same_context_refusal_either_way(engine, suite, rows, tmp_path,
                                                                                  monkeypatch):
    from jex.tasks.capture.engine_calls import prepared_questions

    lengths = sorted(len(q.prompt_ids) for q in prepared_questions(engine, rows))
    monkeypatch.setattr(engine, "max_context", lengths[len(lengths) // 2])
    _, ahead = fast_pass_in(tmp_path / "ahead", suite, monkeypatch, ahead=True)
    _, inline = fast_pass_in(tmp_path / "inline", suite, monkeypatch, ahead=False)
    assert 0 < ahead.context_refusals < len(rows) and ahead.context_refusals == inline.context_refusals
    assert Path(ahead.capture).read_bytes() == Path(inline.capture).read_bytes()


@pytest.mark.slow
def test_the_reason_stage_output_has_the_same_bytes_with_and_without_preparing_ahead(engine, suite, tmp_path,
                                                                                      monkeypatch):
    from jex.engine_spec import EngineSpec
    from jex.tasks.capture.stages import PREPARE_AHEAD_ENV, reason_stage
    from jex.tasks.decision_stages import gate_stage
    from jex.tasks.store import LocalStore

    bundle, fast = fast_pass_in(tmp_path / "fast", suite, monkeypatch, ahead=True)
    gate = gate_stage(LocalStore(tmp_path / "fast"), bundle=bundle, fast=fast, coverage=0.25)
    reasoned = {}
    for ahead in (True, False):
        monkeypatch.setenv(PREPARE_AHEAD_ENV, "1" if ahead else "0")
        reasoned[ahead] = reason_stage(LocalStore(tmp_path / f"reason-{ahead}"), bundle=bundle, gate=gate,
                                       engine=EngineSpec(), max_tokens=4, shard_rows=2)
    assert reasoned[True].shards >= 2 and reasoned[True].sha256 == reasoned[False].sha256
    assert Path(reasoned[True].reasoned).read_bytes() == Path(reasoned[False].reasoned).read_bytes()


def test_the_preparing_thread_gets_its_own_copy_of_the_tokenizer(engine):
    prepared = engine.preparer()
    assert prepared is not engine and prepared.tokenizer is not engine.tokenizer
    assert prepared.encode_many(["Answer: B"]) == engine.encode_many(["Answer: B"])


def test_a_tokenizer_that_does_not_survive_a_copy_is_shared_instead(engine):
    """As vLLM's cached tokenizer on the H200: its deep copy could not encode."""
    import copy

    class CopiesBroken:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

        def __deepcopy__(self, memo):
            return CopiesBroken(None)

    shared = copy.copy(engine)
    shared.tokenizer = CopiesBroken(engine.tokenizer)
    assert shared.preparer() is shared
