"""Every stage's inputs record drives its key: each keyed field changes the key, no unkeyed one does,
and a record refuses a field it does not declare (so an input cannot bypass the key)."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pydantic
import pytest

from jex.engine.fingerprint import engine_fingerprint
from jex.engine_identity import EngineFingerprint, RenderDigest
from jex.engine_spec import EngineSpec
from jex.overlays.rules import AbstainBelow
from jex.tasks.inputs import (
    STAGE_INPUTS,
    BundleInputs,
    FastPassInputs,
    OverlayInputs,
    ReasonInputs,
    StageInputs,
)
from jex.tasks.keys import KeyedThrough, Unkeyed
from jex.tasks.records import (
    BundleSummary,
    CalibrateSummary,
    FastPassSummary,
    FoldSummary,
    GateSummary,
    GenerateSummary,
    OverlaySummary,
    RationaleTokens,
    ReasonSummary,
    StageSummary,
)

FP = EngineFingerprint(kind="hf", engine_version=1, weights_sha256="cd" * 32, tokenizer_sha256="ef" * 32,
                       device_type="cpu", renderer=RenderDigest(version="jex-render/2", sha256="01" * 32))


def _engine_summary_fields() -> dict[str, Any]:
    return {"rows": 9, "shards": 1, "engine": FP}


SUMMARIES: dict[type[StageSummary], StageSummary] = {
    BundleSummary: BundleSummary(key="k", sha256="a1" * 32, bundle="b.tar.gz", rows=9),
    FastPassSummary: FastPassSummary(key="k", sha256="a2" * 32, capture="c.parquet", shard_rows=4,
                                     **_engine_summary_fields()),
    GateSummary: GateSummary(key="k", sha256="a3" * 32, gated="g.parquet", rows=3),
    ReasonSummary: ReasonSummary(key="k", sha256="a4" * 32, reasoned="r.parquet",
                                 rationale_tokens=RationaleTokens(mean=1.0, max=2, hit_max_tokens=0),
                                 **_engine_summary_fields()),
    FoldSummary: FoldSummary(key="k", sha256="a5" * 32, folded="f.parquet", fold_json="f.json", errors={}),
    CalibrateSummary: CalibrateSummary(key="k", sha256="a6" * 32, calibrated="c.parquet", calibration_json="c.json"),
    OverlaySummary: OverlaySummary(key="k", sha256="a7" * 32, predictions="p.parquet", applied=[]),
    GenerateSummary: GenerateSummary(key="k", sha256="a8" * 32, generated="g.parquet",
                                     generated_tokens=RationaleTokens(mean=1.0, max=2, hit_max_tokens=0),
                                     **_engine_summary_fields()),
}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A model folder whose fingerprint can be taken (config, weights, tokenizer files), never loaded."""
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "tokenizer.json").write_text('{"vocab": 1}')
    return folder


@pytest.fixture(scope="module")
def suite_folder(tmp_path_factory) -> Path:
    from jex.sample_suite import write_sample_suite

    return Path(write_sample_suite(tmp_path_factory.mktemp("suite"), rows=18, seed=3))


def example(cls: type[StageInputs], model: Path, suite: Path) -> StageInputs:
    """A valid record of `cls` with a value for every field."""
    values: dict[str, Any] = {}
    for name, field in cls.model_fields.items():
        if name == "stage":
            continue
        annotation = field.annotation
        summary = next((t for t in SUMMARIES if _mentions(annotation, t)), None)
        if summary is not None:
            values[name] = SUMMARIES[summary]
        elif name == "engine":
            values[name] = EngineSpec(model=str(model))
        elif name == "suite":
            values[name] = str(suite)
        elif name == "engine_fp" and not field.is_required():
            values[name] = None
        elif name == "engine_fp":
            values[name] = FP
        elif not field.is_required():
            continue
        else:
            values[name] = {"rule": "mix", "weight": 0.5, "draws": 10, "seed": 1, "coverage": 0.2, "folds": 5,
                            "max_tokens": 8, "rows": 4}[name]
    return cls(**values)


def _mentions(annotation: Any, t: type) -> bool:
    return annotation is t or t in typing.get_args(annotation)


def variant(inputs: StageInputs, name: str, tmp_path: Path) -> StageInputs:
    """The same record with field `name` changed to another valid value."""
    value = getattr(inputs, name)
    if isinstance(value, StageSummary):
        new: Any = value.model_copy(update={"sha256": "ff" * 32})
    elif isinstance(value, EngineSpec):
        new = value.model_copy(update={"dtype": "bfloat16"})
    elif name == "engine_fp":
        new = (value or FP).model_copy(update={"weights_sha256": "99" * 32})
    elif name == "suite":
        (tmp_path / "other").mkdir()
        new = str(_copy_suite(Path(value), tmp_path / "other"))
    elif name == "reference":
        new = str(tmp_path / "reference.jsonl")
        Path(new).write_text('{"run_id": "x", "choice": 0}\n')
    elif name == "rules":
        new = [AbstainBelow(id="r1", target="arith", projection_class="fitted-on-public-oof", p_min=0.4)]
    elif name == "rules_sha256":
        new = "ab" * 32
    elif name == "rule":
        new = "replace"
    elif isinstance(value, bool):
        new = not value
    elif isinstance(value, float):
        new = value / 2
    elif isinstance(value, int):
        new = value + 1
    elif value is None:
        new = {"per_catalog_cap": 0.5, "sample_every": 3}[name]
    else:
        raise AssertionError(f"no variant for {type(inputs).__name__}.{name} = {value!r}: add one here")
    return inputs.model_copy(update={name: new})


def _copy_suite(src: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(src, dest, dirs_exist_ok=True)
    rows = next(p for p in dest.rglob("*.jsonl"))
    rows.write_text(rows.read_text().replace('"prompt": "', '"prompt": "Changed: ', 1))
    return dest


def _marker(cls: type[StageInputs], name: str) -> Any:
    return next((m for m in cls.model_fields[name].metadata if isinstance(m, Unkeyed | KeyedThrough)), None)


FIELDS = [(cls, name) for cls in STAGE_INPUTS for name in cls.model_fields if name != "stage"]


@pytest.mark.parametrize(("cls", "name"), FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FIELDS])
def test_a_keyed_field_changes_the_key_and_an_unkeyed_one_does_not(cls, name, model_folder, suite_folder, tmp_path):
    inputs = example(cls, model_folder, suite_folder)
    changed = variant(inputs, name, tmp_path)
    assert changed != inputs
    if isinstance(_marker(cls, name), Unkeyed):
        assert changed.key() == inputs.key(), f"{cls.__name__}.{name} is marked unkeyed but changes the key"
    else:
        assert changed.key() != inputs.key(), f"{cls.__name__}.{name} does not reach the key"


def test_an_optional_input_left_unset_is_absent_from_the_key(model_folder, suite_folder):
    """`KeyedWhenSet`: a campaign without generative catalogs keeps the score key it had before they existed."""
    from jex.tasks.inputs import ScoreInputs

    inputs = example(ScoreInputs, model_folder, suite_folder)
    assert "generated" in inputs.key_doc()
    unset = inputs.model_copy(update={"generated": None})
    assert "generated" not in unset.key_doc() and unset.key() != inputs.key()


@pytest.mark.parametrize("cls", STAGE_INPUTS, ids=[c.__name__ for c in STAGE_INPUTS])
def test_an_undeclared_input_is_refused(cls, model_folder, suite_folder):
    fields = example(cls, model_folder, suite_folder).model_dump()
    with pytest.raises(pydantic.ValidationError, match="extra"):
        cls.model_validate({**fields, "shard_size": 3})


def test_the_fast_pass_key_ignores_a_speculative_profile_and_the_reason_key_does_not(model_folder):
    bundle = SUMMARIES[BundleSummary]
    plain, ngram = EngineSpec(model=str(model_folder)), EngineSpec(model=str(model_folder), profile="audit-ngram")
    assert FastPassInputs(bundle=bundle, engine=plain).key() == FastPassInputs(bundle=bundle, engine=ngram).key()
    gate = SUMMARIES[GateSummary]
    assert (ReasonInputs(bundle=bundle, gate=gate, engine=plain, max_tokens=8).key()
            != ReasonInputs(bundle=bundle, gate=gate, engine=ngram, max_tokens=8).key())


def test_a_measured_fingerprint_equal_to_the_local_one_gives_the_same_key(model_folder):
    """A machine that measures the same engine computes the key the orchestrator expects."""
    engine = EngineSpec(model=str(model_folder))
    local = FastPassInputs(bundle=SUMMARIES[BundleSummary], engine=engine)
    assert local.model_copy(update={"engine_fp": engine_fingerprint(engine)}).key() == local.key()


@pytest.mark.parametrize("change", ["weights", "tokenizer", "render", "dtype", "batch-invariance"])
def test_what_changes_the_numbers_changes_the_fingerprint(change, model_folder, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    before = engine_fingerprint(EngineSpec(model=str(folder)))
    spec = EngineSpec(model=str(folder))
    if change == "weights":
        (folder / "model.safetensors").write_bytes(b"other weights")
    elif change == "tokenizer":
        (folder / "tokenizer.json").write_text('{"vocab": 2}')
    elif change == "render":
        spec = spec.model_copy(update={"render": spec.render.model_copy(update={"system_prompt": "Be brief."})})
    elif change == "dtype":
        spec = spec.model_copy(update={"dtype": "bfloat16"})
    else:
        spec = spec.model_copy(update={"kind": "hf-batched"})
    assert engine_fingerprint(spec) != before


def test_the_fingerprint_holds_no_library_version_or_commit(model_folder):
    doc = engine_fingerprint(EngineSpec(model=str(model_folder))).model_dump()
    assert not {"torch", "transformers", "vllm", "commit", "jex"} & set(doc)


def test_the_overlay_inputs_of_a_rule_file_key_on_its_rules(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rules]]\nkind = "abstain-below"\nid = "a"\ntarget = "arith"\n'
                     'projection_class = "fitted-on-public-oof"\np_min = 0.3\n')
    calibrated = SUMMARIES[CalibrateSummary]
    a = OverlayInputs.from_file(calibrated, str(rules))
    assert a.rules_sha256 and len(a.rules) == 1
    assert a.key() != OverlayInputs.from_file(calibrated, None).key()


def test_a_bundle_is_keyed_by_its_suite_content_not_its_path(suite_folder, tmp_path):
    import shutil

    moved = tmp_path / "elsewhere"
    shutil.copytree(suite_folder, moved)
    assert BundleInputs(suite=str(moved)).key() == BundleInputs(suite=str(suite_folder)).key()
