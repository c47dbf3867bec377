"""The stages' JSON documents are typed records: they keep the files' shape (keys left out while None),
refuse unknown fields, and the fleet's golden verdicts name a fingerprint mismatch as its own kind."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from jex.fileio import canonical_json
from jex.tasks.documents import BootstrapParams, CatalogResult, GoldenVerdict, LegScore, ScoreDoc, read_doc, write_doc


def score_doc() -> ScoreDoc:
    cat = CatalogResult(n=4, correct=2, unsupported=1, acc=0.5, chance=0.25, skill=1 / 3, weight=1.0, leg="P",
                        kind="accuracy", value=0.5, abstained=0, ci=(0.1, 0.6))
    return ScoreDoc(full=33.3, full_raw=50.0, legs={"P": LegScore(index=33.3, raw=50.0, ci=(10.0, 60.0))},
                    catalogs={"a": cat}, ci=(10.0, 60.0), bootstrap=BootstrapParams(draws=10, seed=1))


def test_a_score_doc_leaves_out_what_it_does_not_have_and_reads_back_the_same(tmp_path):
    doc = score_doc()
    dumped = doc.model_dump(mode="json")
    assert "reference_audit" not in dumped and "provenance" not in dumped  # absent, as before the records
    assert dumped["catalogs"]["a"]["ci"] == [0.1, 0.6] and dumped["bootstrap"]["cluster"] == "question_id"
    write_doc(tmp_path / "score.json", doc.model_copy(update={"provenance": {"jex": {"version": "x"}}}))
    back = read_doc(ScoreDoc, tmp_path / "score.json")
    assert back.provenance == {"jex": {"version": "x"}}
    assert (tmp_path / "score.json").read_text() == canonical_json(back.model_dump(mode="json"))


def test_a_document_refuses_a_field_it_does_not_know():
    with pytest.raises(ValidationError, match="extra"):
        ScoreDoc.model_validate({**score_doc().model_dump(mode="json"), "surprise": 1})


def test_a_fingerprint_mismatch_is_its_own_golden_entry_not_a_verdict():
    from jex.engine_identity import EngineFingerprint, RenderDigest
    from jex.flows.machines.golden import GoldenMismatch
    from jex.flows.machines.machines_doc import FingerprintMismatch, GoldenReplay, MachinesDoc, machines_section

    replay = GoldenReplay(machine="m0", reference="ref.parquet", established=False, ok=True, rows=6, max_abs_dp=2e-6,
                          tolerance=1e-4)
    fp = EngineFingerprint(kind="hf", engine_version=1, weights_sha256="w", tokenizer_sha256="t", device_type="cuda",
                           renderer=RenderDigest(version="1", sha256="r"), dtype="fp32")
    mismatch = FingerprintMismatch(machine="m1", fingerprint=fp.model_copy(update={"dtype": "bf16"}), expected=fp)
    doc = MachinesDoc.model_validate({
        "provider": "local", "workers": 2, "slots": 1, "engine_hosts": True, "engine_starts": 0, "machines": [],
        "golden": [replay.model_dump(mode="json"), mismatch.model_dump(mode="json")],
        "ledger": {"campaign": "c", "machines": [], "total_usd": 0.0, "machine_seconds": 0.0}})
    assert doc.golden == [replay, mismatch]
    assert isinstance(replay, GoldenVerdict) and not isinstance(mismatch, GoldenVerdict)
    text = "\n".join(machines_section(doc))
    assert "Golden replay on m0: 6 rows, max |dp| 2e-06 (tolerance 1e-04), against ref.parquet." in text
    assert "Golden replay on m1: not compared, its engine fingerprint differs" in text
    message = str(GoldenMismatch("m1", mismatch))
    assert "engine fingerprint" in message and "inf" not in message
    assert "worst rows" in str(GoldenMismatch("m0", replay.model_copy(update={"ok": False, "max_abs_dp": 0.2})))
