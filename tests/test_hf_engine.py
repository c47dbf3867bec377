"""The HF reference engine on the embedded model (slow: loads SmolLM2 on CPU)."""

from __future__ import annotations

import json
import math
import random

import pytest

from jex.engine.hf import HFEngine
from jex.engine.types import FinishReason, GenerateRequest, ReadoutMode, ReadoutRequest
from jex.tasks.capture.engine_calls import fast_pass
from tests.conftest import row

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    return HFEngine(batch_invariant=True, batch_size=8)


@pytest.fixture(scope="module")
def requests(engine, sample_suite):
    from jex.engine.render import render_question
    from jex.suite import iter_rows

    rows = list(iter_rows(sample_suite))[::24][:12]
    out = []
    for r in rows:
        rr = render_question(engine.chat_prompt, run_id=r.run_id, prompt=r.prompt, labels=r.labels,
                             options=r.options)
        out.append(ReadoutRequest(r.run_id, rr.prompt, rr.labels, rr.options))
    return out


def test_label_slot_is_bit_identical_across_batch_sizes_and_order(engine, requests):
    engine.batch_size = 1
    one = {r.run_id: r.raw_logprobs for r in engine.readout(requests)}
    engine.batch_size = 8
    eight = {r.run_id: r.raw_logprobs for r in engine.readout(requests)}
    shuffled = list(requests)
    random.Random(0).shuffle(shuffled)
    again = {r.run_id: r.raw_logprobs for r in engine.readout(shuffled)}
    assert one == eight == again  # exact float equality, not approx


def test_packed_label_slot_is_bit_identical_to_one_forward_per_row(engine, requests, monkeypatch):
    from jex.engine import hf_packed

    assert engine.packs_rows
    seqs = [engine.encode(r.prompt) for r in requests]
    assert all(p.prefix > 0 for p in hf_packed.plan_packs(seqs, 200) if len(p.rows) > 1)  # the chat turn, once
    packed = {}
    for tokens in (4096, 200):  # every row in one pack; two or three rows per pack
        monkeypatch.setattr(hf_packed, "PACK_TOKENS", tokens)
        packed[tokens] = [r.raw_logprobs for r in engine.readout(requests)]
    monkeypatch.setattr(engine, "packs_rows", False)
    one_per_row = [r.raw_logprobs for r in engine.readout(requests)]
    assert packed[4096] == packed[200] == one_per_row  # exact float equality, whatever the packing


def test_a_pack_whose_shared_prefix_differs_between_rows_is_read_again_without_sharing(engine, requests,
                                                                                      monkeypatch):
    from jex.engine import hf_packed

    want = [r.raw_logprobs for r in engine.readout(requests)]
    unshared = []
    monkeypatch.setattr(hf_packed, "_same_outputs", lambda a, b: False)
    monkeypatch.setattr(hf_packed, "_forward", lambda model, rows, prefix, keep, f=hf_packed._forward:
                        unshared.append(prefix == 0) or f(model, rows, prefix, keep))
    assert [r.raw_logprobs for r in engine.readout(requests)] == want
    assert unshared.count(True) == unshared.count(False) > 0  # each pack once shared, then again without


def test_packed_prompts_keep_the_cache_and_last_logits_of_their_own_forward(engine):
    """The lock-step decoder's prefill (engine/hf_packed.py): prompts read packed behind their shared chat
    turn leave each prompt's own keys, values and next-token logits, bit for bit."""
    import torch

    from jex.engine.hf_packed import forward_rows, head_logits

    seqs = [engine.encode(engine.chat_prompt(q)) for q in ("Name a colour.", "Why is the sky blue?", "2 + 2 = ?")]
    packed = forward_rows(engine.model, seqs, keep_cache=True)
    for seq, states in zip(seqs, packed, strict=True):
        with torch.inference_mode():
            own = engine.model(input_ids=torch.tensor([seq]), use_cache=True, logits_to_keep=1)
            assert torch.equal(head_logits(engine.model, states.last_hidden), own.logits[0, -1])
        layers = own.past_key_values.layers
        assert len(layers) == len(states.keys) == len(states.values)
        assert all(torch.equal(mine.keys, k) and torch.equal(mine.values, v)
                   for mine, k, v in zip(layers, states.keys, states.values, strict=True))


def test_packs_share_their_rows_common_prefix_within_the_token_budget():
    from jex.engine.hf_packed import Pack, plan_packs

    head = [1, 2, 3, 4]
    seqs = [head + [5, 6], head + [7], head + [5, 8], [9, 9, 9], head]
    assert plan_packs(seqs, 10) == [Pack([0, 1, 2], 4), Pack([3, 4], 0)]  # 4 + 2 + 1 + 2 tokens; no common head
    assert plan_packs([head + [5], head], 100) == [Pack([0, 1], 3)]  # each row keeps its last token
    assert plan_packs([head * 5, head], 8) == [Pack([0], 0), Pack([1], 0)]  # a longer row alone


def test_label_slot_matches_a_plain_transformers_forward(engine, requests):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine.path)
    model = AutoModelForCausalLM.from_pretrained(engine.path, dtype=torch.float32)
    for req, got in zip(requests[:4], engine.readout(requests[:4]), strict=True):
        ids = tok(req.prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, -1].double(), dim=-1)
        label_ids = [tok.encode(" " + lab, add_special_tokens=False)[0] for lab in req.labels]
        want = [float(lp[t]) for t in label_ids]
        assert max(abs(a - b) for a, b in zip(got.raw_logprobs, want, strict=True)) < 1e-5
        assert got.label_mass == pytest.approx(sum(math.exp(x) for x in want), abs=1e-5)
        assert math.fsum(math.exp(x) for x in got.logprobs) == pytest.approx(1.0, abs=1e-12)


def test_batched_mode_is_close_but_says_it_is_not_invariant(requests):
    batched = HFEngine(batch_invariant=False, batch_size=8)
    ref = HFEngine(batch_invariant=True)
    a, b = ref.readout(requests), batched.readout(requests)
    assert max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra.raw_logprobs, rb.raw_logprobs,
                                                                                 strict=True)) < 1e-3
    assert batched.provenance()["batch_invariant_method"] is None
    assert "per-request" in ref.provenance()["batch_invariant_method"]


def test_option_continuation_sums_option_token_logprobs(engine):
    import torch

    req = ReadoutRequest("x", engine.chat_prompt("Name a colour.") + "Answer:", ("A", "B"), ("red", "blue sky"))
    got = engine.readout([req], ReadoutMode.OPTION_CONTINUATION)[0]
    for k, opt in enumerate(req.options):
        ctx, cont = engine.encode(req.prompt), engine.encode(" " + opt)
        with torch.no_grad():
            lp = torch.log_softmax(engine.model(torch.tensor([ctx + cont])).logits[0].float(), -1)
        want = sum(float(lp[len(ctx) + i - 1, t]) for i, t in enumerate(cont))
        assert got.raw_logprobs[k] == pytest.approx(want, abs=1e-4)
    assert got.label_mass is None and got.mode is ReadoutMode.OPTION_CONTINUATION


def test_multi_token_label_is_a_counted_refusal_not_an_answer(engine):
    req = ReadoutRequest("x", engine.chat_prompt("Pick one.") + "Answer:", ("A", "Zebra-42"), ("a", "b"))
    got = engine.readout([req])[0]
    assert got.logprobs is None and got.choice is None
    assert got.refusal.startswith("label token") and "Zebra-42" in got.refusal


def test_prompt_longer_than_context_is_refused():
    small = HFEngine(max_context=32)
    long_prompt = "word " * 100
    got = small.readout([ReadoutRequest("x", long_prompt, ("A", "B"), ("a", "b"))])[0]
    assert got.refusal.startswith("context") and got.logprobs is None
    gen = small.generate([GenerateRequest("x", long_prompt, 8)])[0]
    assert gen.finish_reason is FinishReason.REFUSED and gen.token_ids == ()


def test_greedy_generation_is_deterministic_and_honours_stop(engine):
    prompt = engine.chat_prompt("Count from 1 to 20, separated by commas.")
    a = engine.generate([GenerateRequest("x", prompt, 24)])[0]
    b = engine.generate([GenerateRequest("x", prompt, 24)])[0]
    assert a == b and 0 < len(a.token_ids) <= 24
    middle = len(a.text) // 2
    stop = a.text[middle:middle + 2]  # a string the unconstrained run is known to produce
    stopped = engine.generate([GenerateRequest("x", prompt, 24, stop=(stop,))])[0]
    assert stopped.text == a.text[: a.text.find(stop)] and stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == a.token_ids[: len(stopped.token_ids)]
    fixed = engine.generate([GenerateRequest("x", prompt, 12, ignore_eos=True)])[0]
    assert len(fixed.token_ids) == 12


def test_provenance_serialises_and_names_weights(engine):
    prov = engine.provenance()
    text = json.dumps(prov, default=str)
    assert len(prov["weights_sha256"]) == 64
    assert "renderer" not in prov  # what is rendered is the campaign's (EngineSpec.render), keyed by its fingerprint
    assert "torch" in text and prov["batch_invariant"] is True


def test_fast_pass_on_suite_rows(engine):
    rows = [row("r1", "c", k=4, gold=1), row("r2", "c", k=2, gold=0)]
    from jex.tasks.capture.engine_calls import as_row

    out = fast_pass(engine, [as_row(r) for r in rows])
    assert [len(o.logprobs) for o in out] == [4, 2] and all(0.3 < o.label_mass <= 1 for o in out)


def test_batch_tokenisation_gives_the_ids_of_one_text_at_a_time(engine, requests):
    texts = [r.prompt for r in requests] + ["", " A", "Ünïcode — «quotes» 漢字", "trailing space "]
    assert engine.encode_many(texts) == [engine.encode(t) for t in texts]
    assert engine.encode_many([]) == []


def test_label_ids_are_computed_once_per_label(engine, requests, monkeypatch):
    engine.readout(requests[:2])  # the labels of these rows are known now
    calls = []
    monkeypatch.setattr(engine, "encode", lambda text: calls.append(text) or [])
    engine.readout(requests[:2])
    assert calls == []  # prompts go through encode_many; no label is encoded again


def test_a_decode_product_gives_each_row_the_same_numbers_whichever_rows_share_it():
    """The assumption lock-step decoding rests on (engine/hf_decode.py): a linear layer's output for a row
    does not depend on the other rows of its fixed-shape product, nor on the row's place in it."""
    import torch

    from jex.engine.hf_decode import GEMM_ROWS, _row_linear

    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(576, 1536, bias=False)
    rows = torch.randn(3, 576, generator=gen)
    alone = _row_linear(layer, rows)
    for others in (1, GEMM_ROWS - 3, 2 * GEMM_ROWS + 1):
        mixed = torch.cat([torch.randn(others, 576, generator=gen), rows.flip(0)])
        assert torch.equal(_row_linear(layer, mixed)[others:].flip(0), alone), others


def test_lockstep_generation_gives_each_row_the_same_tokens_at_every_batch_size_and_order(engine, monkeypatch):
    """Batch-invariant generation decodes the requests of a call in lock-step (engine/hf_decode.py), in
    groups as large as their cache allows: each row's token ids are the same whatever the group, the
    order and the finish order of the others."""
    from jex.engine import hf_decode

    prompts = [engine.chat_prompt("Count from 1 to 20, separated by commas."),
               engine.chat_prompt("Name a colour."),
               engine.chat_prompt("Explain in one sentence why the sky is blue, and then say which planet is "
                                  "the largest in the solar system.")]
    stops = {prompts[0]: ("\n3",)}  # one row's stop string: each group must check its own rows' stops

    def generate(order: list[str]) -> list[tuple[int, ...]]:
        return [g.token_ids for g in engine.generate([GenerateRequest(f"r{i}", p, 16, stop=stops.get(p, ()))
                                                      for i, p in enumerate(order)])]

    assert engine.decodes_in_lockstep
    with monkeypatch.context() as m:
        m.setattr(hf_decode, "GROUP_CACHE_BYTES", 0)  # a group of one row each
        ref = generate(prompts[::-1])[::-1]
    assert all(len(t) > 1 for t in ref)
    assert engine.tokenizer.decode(list(ref[0])).endswith("\n3") and len(ref[0]) < 16
    for order, want in ((prompts[:2], ref[:2]), (prompts, ref), (prompts + prompts, ref * 2)):
        assert generate(order) == want, len(order)
