"""The suite format: a TOML manifest plus row files (JSONL or Parquet), validated as they stream.

A manifest (`SUITE_DIR/suite.toml`) has a `[legs]` table of composite weights and one
`[[catalogs]]` entry per catalog. A row is one multiple-choice request, or in a generative catalog
(`kind = "generate"`) a prompt and its reference answer. Every validation error is
an `InputError` naming the file, the row (1-based line for JSONL, 0-based index for Parquet) and
the field.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from jex.answer_extraction import NO_FILTER, AnswerFilter, MatchSettings, TakeFirstKStep
from jex.errors import InputError

MANIFEST_NAME = "suite.toml"
ScoringKind = Literal["accuracy", "acc_norm", "brier", "log_loss", "calibrated_accuracy", "true_mass", "exact_match",
                      "pass_at_k", "maj_at_k"]
"""What a catalog's skill is computed from (`tasks/scoring/index.py` defines each)."""
GENERATIVE_KINDS: tuple[ScoringKind, ...] = ("exact_match", "pass_at_k", "maj_at_k")
"""The scoring kinds of generative catalogs: the primary filter's verdict, pass@k over a row's samples (the
unbiased estimator) and maj@k (the verdict of the first k samples' majority answer)."""
ReadoutKind = Literal["label_slot", "loglikelihood", "partial_loglikelihood"]
"""How the fast pass reads a catalog's rows (`Catalog.readout`)."""
LOGLIKELIHOOD_READOUTS: tuple[ReadoutKind, ...] = ("loglikelihood", "partial_loglikelihood")
"""The readouts that score each option by a continuation's log-likelihood, as lm-eval's `loglikelihood`."""
LOGLIKELIHOOD_KINDS = ("acc_norm", "true_mass")
"""Scoring kinds read from each option's continuation log-likelihood (a `loglikelihood` readout)."""
ROW_FIELDS = ("run_id", "catalog", "question_id", "prompt", "options", "labels", "gold", "metadata", "true_options")
GENERATION_ROW_FIELDS = ("run_id", "catalog", "question_id", "prompt", "answer", "metadata")
CatalogKind = Literal["multiple_choice", "generate"]
"""A catalog of multiple-choice rows (read by the fast pass), or of generative rows (a prompt the model
continues and a reference answer its extracted answer must match, as lm-eval's `generate_until` tasks)."""


class Thinking(BaseModel):
    """A reasoning model's thought, by the delimiter that closes it (the one that opens it, `<think>`, is the
    thought's own text or the chat template's). The answer is the text after the last `end`, its leading
    whitespace stripped, then cut at the stop sequences (lm-eval's `think_end_token`); a generation without
    `end` never closed its thought and is read whole, as lm-eval reads it (counted and shown)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    end: str = Field(min_length=1, description="What closes the thought, e.g. </think>")


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "samples", "seed", "thinking")
"""`GenerationSettings`' fields left out of its dump at their defaults, so a greedy catalog keeps its bytes."""


def sample_seed(seed: int, run_id: str, index: int) -> int:
    """The seed of sample `index` of row `run_id`: a hash of the three (never of where the row is computed, so a
    row's samples are the same in any batch, shard or machine), 63 bits (vLLM and torch take it as an int64)."""
    digest = hashlib.sha256(json.dumps([seed, run_id, index]).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class GenerationSettings(BaseModel):
    """How a generative catalog's rows are generated: up to `max_tokens` new tokens (the thought included), the
    text cut at the first of the stop sequences (lm-eval's `until` and `max_gen_toks`); greedy unless a
    temperature is set, `samples` generations per row (lm-eval's `repeats`), each seeded by `sample_seed`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    until: tuple[str, ...] = Field((), description="Stop sequences: the text is cut before the first one")
    max_tokens: int = Field(256, ge=1, description="Most new tokens per row, thought and answer together "
                                                   "(lm-eval's max_gen_toks)")
    temperature: float = Field(0.0, ge=0, description="0: greedy; above: sampled at this temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="Sampling: the smallest set of tokens of this much "
                                                      "probability (1: all)")
    top_k: int = Field(0, ge=0, description="Sampling: the k most likely tokens only (0: all)")
    samples: int = Field(1, ge=1, le=4096, description="Generations per row (lm-eval's repeats)")
    seed: int = Field(0, ge=0, description="Sampling: with the row's run_id and the sample's index, the seed of "
                                           "each sample")
    thinking: Thinking | None = Field(None, description="A reasoning model's thought delimiters; the answer is "
                                                        "read after the thought")

    @model_serializer(mode="wrap")
    def _without_sampling_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        doc: dict[str, Any] = handler(self)
        for name in SAMPLING_FIELDS:
            if name in doc and getattr(self, name) == GenerationSettings.model_fields[name].get_default():
                del doc[name]
        return doc

    @model_validator(mode="after")
    def _sampling_needs_a_temperature(self) -> GenerationSettings:
        if self.temperature == 0 and (self.top_p != 1 or self.top_k != 0):
            raise ValueError("top_p and top_k shape sampling: set a temperature above 0 (0 is greedy)")
        return self

    @property
    def sampled(self) -> bool:
        """Generated by sampling (a temperature above 0), each sample with its own seed."""
        return self.temperature > 0


READOUT_FIELDS = ("readout", "prompt_format", "target_delimiter")
GENERATIVE_FIELDS = ("kind", "generation", "filters", "match", "primary_filter", "k")


def without_defaults(doc: dict[str, Any], names: tuple[str, ...], *, json: bool) -> dict[str, Any]:
    """`doc` (a dumped `Catalog`, in JSON or Python mode) less the fields of `names` that hold their defaults."""
    for name in names:
        default = Catalog.model_fields[name].get_default()
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json" if json else "python")
        if name in doc and doc[name] == (list(default) if json and isinstance(default, tuple) else default):
            del doc[name]
    return doc


class Catalog(BaseModel):
    """One benchmark catalog of the suite."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    leg: str = Field(min_length=1, description="Composite leg, e.g. public, eqS, eqO")
    area: str = "general"
    weight: float = Field(1.0, gt=0)
    chance: float | None = Field(None, ge=0, lt=1, description="None: mean of 1/len(options)")
    files: tuple[str, ...] = Field(min_length=1, description="Row files, relative to the suite dir")
    exclusions: tuple[str, ...] = Field((), description="run_ids dropped at scoring time")
    fewshot_files: tuple[str, ...] = Field((), description="Solved example rows for few-shot prompts (not scored)")
    scoring: ScoringKind = Field(
        "accuracy", description="What the catalog's skill is computed from (docs/suite-and-scoring.md); "
                                "acc_norm: lm-eval's length-normalised accuracy; true_mass: the probability "
                                "mass of the row's true options, as lm-eval's TruthfulQA mc2 computes it "
                                "(both: loglikelihood readout only)")
    readout: ReadoutKind = Field(
        "label_slot", description="How the fast pass reads a row: label_slot (one forward, the label tokens "
                                  "after the answer slot), loglikelihood (lm-eval's: each choice's "
                                  "continuation log-likelihood given the prompt) or partial_loglikelihood "
                                  "(lm-eval's partial evaluation, Winogrande: each option is a context, the "
                                  "prompt the continuation whose log-likelihood is read after each)")
    prompt_format: Literal["template", "verbatim"] = Field(
        "template", description="template: the row's prompt goes through jex's question template and option "
                                "block; verbatim: the row's prompt is the exact context the model reads "
                                "(an imported harness's own prompt, choices already in it where it shows them)")
    target_delimiter: str = Field(" ", description="loglikelihood: the text between the context and each "
                                                   "choice (lm-eval's target_delimiter)")
    kind: CatalogKind = Field("multiple_choice", description="multiple_choice, or generate: rows with a prompt "
                                                             "and a reference answer, scored by exact_match")
    generation: GenerationSettings | None = Field(None, description="generate: stop sequences and max tokens")
    filters: tuple[AnswerFilter, ...] = Field((), description="generate: the named answer extractions (lm-eval's "
                                                              "filter_list); none: the response as it is")
    match: MatchSettings = Field(MatchSettings(), description="generate: exact_match's normalisations")
    primary_filter: str | None = Field(None, description="generate: the filter whose exact_match the index "
                                                         "reads; empty = the first")
    k: int | None = Field(None, ge=1, description="pass_at_k, maj_at_k: the k of pass@k or maj@k (empty: the "
                                                  "generation's samples)")

    def declared(self) -> dict[str, Any]:
        """The catalog as JSON, leaving out the readout and generative fields at their defaults, so a bundle
        of a suite that does not use them keeps the bytes (and so the identity) it had before they existed."""
        return without_defaults(self.model_dump(mode="json"), (*READOUT_FIELDS, *GENERATIVE_FIELDS), json=True)

    def manifest_entry(self) -> dict[str, Any]:
        """The catalog as a `[[catalogs]]` table written back (a panel's suite.toml): every field that is set,
        the generative ones only where they are not their defaults (the bytes of a multiple-choice suite's
        table are those it had before generative catalogs existed)."""
        return without_defaults(self.model_dump(exclude_none=True), GENERATIVE_FIELDS, json=False)
    secondary: tuple[Literal["abstain"], ...] = Field(
        (), description="Secondary prediction fields the scorer reads: 'abstain' (a row the predictor declined)")

    def answer_filters(self) -> tuple[AnswerFilter, ...]:
        """A generative catalog's filters, the one the index reads first (lm-eval's `none` when it declares none)."""
        filters = self.filters or (NO_FILTER,)
        first = next((f for f in filters if f.name == self.primary_filter), filters[0])
        return (first, *(f for f in filters if f is not first))

    @model_validator(mode="after")
    def _kind_fits(self) -> Catalog:
        generative = self.kind == "generate"
        if generative != (self.scoring in GENERATIVE_KINDS):
            raise ValueError(f"catalog '{self.id}': exact_match scores generative catalogs (kind = \"generate\"), "
                             "and only them (or pass_at_k, maj_at_k)")
        if generative and self.generation is None:
            raise ValueError(f"catalog '{self.id}' is generative: it needs a [catalogs.generation] table "
                             "(until, max_tokens)")
        if generative and self.prompt_format != "verbatim":
            raise ValueError(f"catalog '{self.id}' is generative: its prompt is the context the model continues, "
                             "so it needs prompt_format = \"verbatim\"")
        if generative and self.fewshot_files:
            raise ValueError(f"catalog '{self.id}' is generative: its few-shot examples belong in its prompts "
                             "(as lm-eval renders them), not in fewshot_files")
        if not generative and (self.generation or self.filters or self.primary_filter):
            raise ValueError(f"catalog '{self.id}': generation, filters and primary_filter are for generative "
                             "catalogs (kind = \"generate\")")
        self._k_fits()
        names = [f.name for f in self.filters]
        if len(set(names)) != len(names):
            raise ValueError(f"catalog '{self.id}': filter names must be distinct, got {names}")
        if self.primary_filter is not None and self.primary_filter not in names:
            raise ValueError(f"catalog '{self.id}': primary_filter {self.primary_filter!r} is none of its filters "
                             f"{names}")
        return self


    def _k_fits(self) -> None:
        """pass@k and maj@k read k of the row's samples; every take_first_k of a filter as many."""
        samples = self.generation.samples if self.generation is not None else 1
        if self.k is not None and self.scoring not in ("pass_at_k", "maj_at_k"):
            raise ValueError(f"catalog '{self.id}': k is the k of pass_at_k and maj_at_k, not of {self.scoring}")
        if self.k is not None and self.k > samples:
            raise ValueError(f"catalog '{self.id}': k = {self.k}, but the generation has {samples} sample(s) per row "
                             "(raise [catalogs.generation] samples)")
        for f in self.filters:
            for step in f.steps:
                if isinstance(step, TakeFirstKStep) and step.k > samples:
                    raise ValueError(f"catalog '{self.id}': filter '{f.name}' takes the first {step.k} responses, but "
                                     f"the generation has {samples} sample(s) per row")

    @property
    def estimator_k(self) -> int:
        """The k of pass@k or maj@k: the catalog's `k`, else its generation's samples."""
        return self.k or (self.generation.samples if self.generation is not None else 1)


class SuiteManifest(BaseModel):
    """The parsed `suite.toml`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = "suite"
    legs: dict[str, float]
    catalogs: tuple[Catalog, ...] = Field(min_length=1)
    source: dict[str, Any] = Field(default_factory=dict, description="Where the suite came from (importer, "
                                                                      "dataset id, revision, fingerprint)")

    @field_validator("legs")
    @classmethod
    def _positive_legs(cls, legs: dict[str, float]) -> dict[str, float]:
        if not legs:
            raise ValueError("[legs] must name at least one leg")
        for leg, w in legs.items():
            if not w > 0:
                raise ValueError(f"leg '{leg}' must have a positive weight, got {w}")
        return legs

    @model_validator(mode="after")
    def _consistent(self) -> SuiteManifest:
        ids = [c.id for c in self.catalogs]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"duplicate catalog id(s): {dup}")
        for c in self.catalogs:
            if c.leg not in self.legs:
                raise ValueError(f"catalog '{c.id}' names leg '{c.leg}', not in [legs] {sorted(self.legs)}")
            if c.scoring in LOGLIKELIHOOD_KINDS and c.readout != "loglikelihood":
                raise ValueError(f"catalog '{c.id}' is scored by {c.scoring}, which reads each option's "
                                 "log-likelihood: it needs readout = \"loglikelihood\"")
            if c.readout == "partial_loglikelihood" and c.prompt_format != "verbatim":
                raise ValueError(f"catalog '{c.id}' is read by partial evaluation: its options are the contexts "
                                 "the model reads as they are, so it needs prompt_format = \"verbatim\"")
        empty = [leg for leg in self.legs if not any(c.leg == leg for c in self.catalogs)]
        if empty:
            raise ValueError(f"leg(s) {empty} have no catalog")
        return self

    def catalog(self, catalog_id: str) -> Catalog:
        for c in self.catalogs:
            if c.id == catalog_id:
                return c
        raise KeyError(catalog_id)


class GenerationRow(BaseModel):
    """One generative request: the prompt the model continues and the reference answer (`question_id`: the
    bootstrap cluster)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    run_id: str = Field(min_length=1)
    catalog: str = Field(min_length=1)
    question_id: str = Field(min_length=1)
    prompt: str
    answer: str
    metadata: dict[str, Any] | None = None


class SuiteRow(BaseModel):
    """One multiple-choice request. `question_id` is the bootstrap cluster; `true_options`, every option
    that is true, for a catalog scored by `true_mass` (`gold` is one of them)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    run_id: str = Field(min_length=1)
    catalog: str = Field(min_length=1)
    question_id: str = Field(min_length=1)
    prompt: str
    options: list[str] = Field(min_length=2)
    labels: list[str] = Field(min_length=2)
    gold: int
    metadata: dict[str, Any] | None = None
    true_options: list[int] | None = None


def load_manifest(suite_dir: str | Path) -> SuiteManifest:
    """Parse and validate `suite.toml`; errors name the file and the offending key."""
    manifest, problems = _manifest_and_problems(suite_dir)
    if manifest is None:
        raise problems[0]
    return manifest


def _manifest_and_problems(suite_dir: str | Path) -> tuple[SuiteManifest | None, list[InputError]]:
    path = Path(suite_dir) / MANIFEST_NAME
    try:
        raw = tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None, [InputError("no suite manifest here (expected suite.toml)", file=str(path))]
    except UnicodeDecodeError as e:
        return None, [InputError(f"not UTF-8 ({e.reason} at byte {e.start})", file=str(path))]
    except tomllib.TOMLDecodeError as e:
        return None, [InputError(f"invalid TOML: {e}", file=str(path))]
    try:
        return SuiteManifest.model_validate(raw), []
    except ValidationError as e:
        return None, [_manifest_error(err, path) for err in e.errors()]


def _manifest_error(err: Any, path: Path) -> InputError:
    loc = ".".join(str(p) for p in err["loc"])
    row = None
    if len(err["loc"]) >= 2 and err["loc"][0] == "catalogs" and isinstance(err["loc"][1], int):
        row = err["loc"][1]
    msg = err["msg"].removeprefix("Value error, ")
    return InputError(f"{msg} (in [[catalogs]] entry {row})" if row is not None else msg, file=str(path),
                      field=loc or None)


def _check_row(row: SuiteRow | GenerationRow, *, file: str, line: int, catalogs: dict[str, Catalog],
               expected: str | None) -> None:
    def bad(field: str, msg: str) -> InputError:
        return InputError(msg, file=file, row=line, field=field)

    if not row.prompt.strip():
        raise bad("prompt", "empty prompt")
    if row.catalog not in catalogs:
        raise bad("catalog", f"unknown catalog '{row.catalog}' (manifest has {sorted(catalogs)})")
    if expected is not None and row.catalog != expected:
        raise bad("catalog", f"row of catalog '{row.catalog}' in a file listed under '{expected}'")
    if isinstance(row, GenerationRow):
        return
    if len(row.labels) != len(row.options):
        raise bad("labels", f"{len(row.labels)} labels for {len(row.options)} options")
    if len(set(row.labels)) != len(row.labels) or any(not lab.strip() for lab in row.labels):
        raise bad("labels", f"labels must be distinct and non-empty, got {row.labels}")
    if any(not opt.strip() for opt in row.options):
        raise bad("options", "empty option text")
    if not 0 <= row.gold < len(row.options):
        raise bad("gold", f"gold index {row.gold} out of range for {len(row.options)} options")
    if row.true_options is not None:
        if len(set(row.true_options)) != len(row.true_options) or not all(
                0 <= i < len(row.options) for i in row.true_options):
            raise bad("true_options", f"true options must be distinct option indices, got {row.true_options}")
        if row.gold not in row.true_options:
            raise bad("true_options", f"the gold index {row.gold} is not among the true options {row.true_options}")
    elif catalogs[row.catalog].scoring == "true_mass":
        raise bad("true_options", f"catalog '{row.catalog}' is scored by true_mass: every row lists its true options")


def _parse(record: Any, *, file: str, line: int, generative: bool = False) -> SuiteRow | GenerationRow:
    if not isinstance(record, dict):
        raise InputError("a row must be a JSON object", file=file, row=line)
    fields, model = (GENERATION_ROW_FIELDS, GenerationRow) if generative else (ROW_FIELDS, SuiteRow)
    unknown = sorted(set(record) - set(fields))
    if unknown:
        raise InputError(f"unknown field(s) {unknown}" + (" (a generative catalog's row: prompt and answer)"
                                                          if generative else ""), file=file, row=line,
                         field=unknown[0])
    try:
        return model.model_validate(record)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or None
        raise InputError(err["msg"], file=file, row=line, field=field) from None


def read_row_file(path: str | Path, *, problems: list[InputError] | None = None
                  ) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (row number, raw record) from a JSONL or Parquet file, streaming.

    With `problems` given, an undecodable line is recorded there and skipped instead of raised.
    """
    path = Path(path)
    name = str(path)
    if path.suffix == ".parquet":
        pf = pq.ParquetFile(path)
        index = 0
        for batch in pf.iter_batches(batch_size=4096):
            for record in batch.to_pylist():
                if record.get("metadata") is None:
                    record.pop("metadata", None)
                yield index, record
                index += 1
        return
    if path.suffix not in (".jsonl", ".ndjson"):
        raise InputError("row files must be .jsonl or .parquet", file=name)
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
                if not text.strip():
                    continue
                record = json.loads(text)
            except UnicodeDecodeError as e:
                _report(InputError(f"not UTF-8 ({e.reason} at byte {e.start})", file=name, row=line_no), problems)
                continue
            except json.JSONDecodeError as e:
                _report(InputError(f"invalid JSON: {e.msg} at column {e.colno}", file=name, row=line_no), problems)
                continue
            yield line_no, record


def iter_rows(suite_dir: str | Path, manifest: SuiteManifest | None = None, *,
              problems: list[InputError] | None = None) -> Iterator[SuiteRow]:
    """The suite's multiple-choice rows (`iter_all_rows`, less the generative catalogs' rows)."""
    for row in iter_all_rows(suite_dir, manifest, problems=problems):
        if isinstance(row, SuiteRow):
            yield row


def iter_all_rows(suite_dir: str | Path, manifest: SuiteManifest | None = None, *,
                  problems: list[InputError] | None = None) -> Iterator[SuiteRow | GenerationRow]:
    """Stream every row of the suite in manifest order, validated; run_ids must be unique.

    With `problems` given, a bad row is recorded there and skipped instead of raised (`validate`).
    """
    suite_dir = Path(suite_dir)
    manifest = manifest or load_manifest(suite_dir)
    seen: dict[str, str] = {}
    yield from _rows_of(suite_dir, manifest, {c.id: c.files for c in manifest.catalogs}, seen, problems)
    for cat in manifest.catalogs:
        missing = [r for r in cat.exclusions if r not in seen]
        if missing:
            _report(InputError(f"catalog '{cat.id}' excludes unknown run_id(s) {missing[:5]}",
                               file=str(suite_dir / MANIFEST_NAME), field="exclusions"), problems)


def iter_fewshot_rows(suite_dir: str | Path, manifest: SuiteManifest | None = None, *,
                      problems: list[InputError] | None = None) -> Iterator[SuiteRow]:
    """The multiple-choice catalogs' few-shot example rows (same format as rows; never scored), validated.
    (A generative catalog's few-shot examples are already in its prompts, as lm-eval renders them.)"""
    suite_dir = Path(suite_dir)
    manifest = manifest or load_manifest(suite_dir)
    files = {c.id: c.fewshot_files for c in manifest.catalogs if c.kind != "generate"}
    for row in _rows_of(suite_dir, manifest, files, {}, problems):
        if isinstance(row, SuiteRow):
            yield row


def _report(problem: InputError, problems: list[InputError] | None) -> None:
    if problems is None:
        raise problem
    problems.append(problem)


def _rows_of(suite_dir: Path, manifest: SuiteManifest, files: dict[str, tuple[str, ...]], seen: dict[str, str],
             problems: list[InputError] | None) -> Iterator[SuiteRow | GenerationRow]:
    catalogs = {c.id: c for c in manifest.catalogs}
    for cat_id, rels in files.items():
        for rel in rels:
            path = suite_dir / rel
            if not path.is_file():
                _report(InputError(f"row file listed for catalog '{cat_id}' does not exist", file=str(path)),
                        problems)
                continue
            try:
                for line, record in read_row_file(path, problems=problems):
                    try:
                        row = _parse(record, file=str(path), line=line,
                                     generative=catalogs[cat_id].kind == "generate")
                        _check_row(row, file=str(path), line=line, catalogs=catalogs, expected=cat_id)
                        if row.run_id in seen:
                            raise InputError(f"duplicate run_id '{row.run_id}' (first seen at {seen[row.run_id]})",
                                             file=str(path), row=line, field="run_id")
                    except InputError as e:
                        _report(e, problems)
                        continue
                    seen[row.run_id] = f"{path.name}:{line}"
                    yield row
            except InputError as e:  # the file itself cannot be read on (encoding, JSON)
                _report(e, problems)


def validate_suite(suite_dir: str | Path, *, limit: int = 1000) -> list[InputError]:
    """Every problem of a suite (manifest, rows, few-shot rows), each with file, row and field."""
    manifest, problems = _manifest_and_problems(suite_dir)
    if manifest is None:
        return problems
    counts = dict.fromkeys((c.id for c in manifest.catalogs), 0)
    for row in iter_all_rows(suite_dir, manifest, problems=problems):
        counts[row.catalog] = counts.get(row.catalog, 0) + 1
        if len(problems) >= limit:
            return problems
    if not problems:  # a catalog whose rows were all bad is already reported by its rows
        problems += [InputError(f"catalog '{c}' has no rows", file=str(Path(suite_dir) / MANIFEST_NAME),
                                field="files") for c, n in counts.items() if n == 0]
    for _ in iter_fewshot_rows(suite_dir, manifest, problems=problems):
        if len(problems) >= limit:
            break
    return problems
