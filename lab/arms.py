"""Arms files: the base and each arm as a difference from it, validated before any engine starts.

An arms file (TOML) has an optional `name`, an optional `[base]` table (settings applied to the
campaign the CLI or the form describes), a `[gate]` table (the pre-registered test that decides
each arm's verdict, `ExperimentTestSettings`; the table keeps its name `gate`) and one `[[arms]]`
table per arm:

    [[arms]]
    name = "lettered"            # unique; letters, digits, '-', '_', '.'
    kind = "arm"                 # arm | placebo | twin | sweep
    hypothesis = "..."           # free text, copied to the report and the ledger
    reopen_when = "..."          # when a closed hypothesis may be reopened (ledger)
    placebo = "reworded"         # the placebo this arm is judged against (default: [gate]'s)
    fold_weight = 0.8            # campaign settings: CAMPAIGN_SETTINGS
    model = "/path/model.gguf"   # another model
    [arms.render]                # what the engine reads: any `RenderSpec` field
    option_format = "({label}) {option}"
    [arms.engine]                # engine profile settings: ENGINE_SETTINGS

A sweep arm names one `parameter` (a campaign setting, or `render.X` / `engine.X`) and a non-empty
`grid`; each grid value is run as the point `NAME@VALUE`. A placebo may change only what should not
matter (PLACEBO_FIELDS); a twin changes nothing (it re-runs the base in a fresh engine process).
Every error is an `InputError` naming the arms file, the arm and the field.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jex.engine_spec import EngineSpec, RenderSpec, VLLMSettings
from jex.errors import InputError
from jex.fileio import sha256_bytes
from jex.settings import BOOTSTRAP_SEED
from jex.tasks.decisions import ReopenIf

ArmKind = Literal["arm", "placebo", "twin", "sweep"]
CAMPAIGN_SETTINGS = ("coverage", "per_catalog_cap", "reason_max_tokens", "fold_rule", "fold_weight",
                     "calibration_folds", "overlays")
"""Campaign settings an arm may change (the decision stages, and the coverage gate's coverage)."""
ENGINE_SETTINGS = ("kind", "device", "batch_size", "dtype", *VLLMSettings.knobs())
"""Engine profile settings an arm may change (`[arms.engine]`): every vLLM knob, read from its record."""
RENDER_SETTINGS = tuple(RenderSpec.model_fields)
PLACEBO_FIELDS = ("render.question_template", "render.reason_template", "render.option_order_seed")
"""What a placebo may change: the instruction's wording, or the order options are shown in (restored
before scoring). Anything else changes what is read out or scored, which a placebo must not."""
ARM_KEYS = {"name", "kind", "hypothesis", "reopen_when", "reopen_if", "placebo", "parameter", "grid", "render",
            "engine", "model", *CAMPAIGN_SETTINGS}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ExperimentTestSettings(BaseModel):
    """An experiment's pre-registered test (the arms file's `[gate]` table): written and hashed before any
    arm result is read; an arm is GO only when it passes every check (`experiment_report.verdict`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    metric: str = Field("full", description="full, or a leg name: the index the test judges")
    alpha: float = Field(0.05, gt=0, lt=1, description="Permutation p must be below alpha")
    min_effect: float = Field(0.0, ge=0, description="The delta's CI lower end must exceed this (index points)")
    placebo: str | None = Field(None, description="Placebo arm arms are judged against (default: the only one)")
    catalog_tolerance: float = Field(5.0, ge=0, description="No catalog's skill may drop more than this "
                                                            "(index points, point estimate)")
    draws: int = Field(2000, ge=10, description="Paired clustered bootstrap draws")
    seed: int = BOOTSTRAP_SEED
    permutations: int = Field(2000, ge=10, description="Paired sign-flip permutations of question clusters")
    min_retention: float | None = Field(None, ge=0, le=1, description="Retention gate: the share of the base's "
                                        "correct rows the arm keeps correct must be at least this (None: no gate)")


class ArmDecl(BaseModel):
    """One arm as declared: a difference from the base."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    kind: ArmKind = "arm"
    hypothesis: str = ""
    reopen_when: str = ""
    reopen_if: ReopenIf | None = Field(None, description="Typed reopen conditions (`tasks/decisions.py`)")
    placebo: str | None = None
    campaign: dict[str, Any] = Field(default_factory=dict, description="CAMPAIGN_SETTINGS changed")
    render: dict[str, Any] = Field(default_factory=dict)
    engine: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    parameter: str | None = None
    grid: tuple[Any, ...] = ()

    def changes(self) -> list[str]:
        """Dotted names of every setting this arm changes (a sweep's parameter included)."""
        out = [*self.campaign, *(f"render.{k}" for k in self.render), *(f"engine.{k}" for k in self.engine)]
        out += ["model"] if self.model is not None else []
        return out + ([self.parameter] if self.parameter else [])

    def points(self) -> list[tuple[str, ArmDecl]]:
        """A sweep's grid points as plain arms `NAME@VALUE`; any other arm is its own single point."""
        if self.kind != "sweep":
            return [(self.name, self)]
        return [(f"{self.name}@{v}", with_setting(self, self.parameter or "", v)) for v in self.grid]


class ArmsFile(BaseModel):
    """A parsed arms file."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    sha256: str
    name: str = "experiment"
    base: ArmDecl
    test: ExperimentTestSettings = Field(description="The pre-registered test (the file's `[gate]` table)")
    arms: tuple[ArmDecl, ...]

    def arm(self, name: str) -> ArmDecl:
        return next(a for a in self.arms if a.name == name)

    def placebo_of(self, arm: ArmDecl) -> str | None:
        return arm.placebo or self.test.placebo


def with_setting(arm: ArmDecl, dotted: str, value: Any) -> ArmDecl:
    """A copy of `arm` (as kind 'sweep') with one more setting."""
    group, _, key = dotted.partition(".")
    if group in ("render", "engine"):
        return arm.model_copy(update={group: {**getattr(arm, group), key: value}})
    if dotted == "model":
        return arm.model_copy(update={"model": value})
    return arm.model_copy(update={"campaign": {**arm.campaign, dotted: value}})


def _err(path: str, arm: str, field: str, msg: str) -> InputError:
    return InputError(f"arm '{arm}': {msg}", file=path, field=field)


def _decl(raw: dict[str, Any], *, path: str, where: str) -> ArmDecl:
    """One `[[arms]]` (or `[base]`) table into an `ArmDecl`, every key checked."""
    name = raw.get("name", where)
    if not isinstance(name, str) or not NAME.match(name):
        raise _err(path, str(name), "name", "a name is letters, digits, '-', '_' or '.', starting with a letter "
                                            "or digit")
    for key in raw:
        if key not in ARM_KEYS:
            raise _err(path, name, key, f"unknown setting; an arm may set {sorted(ARM_KEYS)}")
    for group, allowed in (("render", RENDER_SETTINGS), ("engine", ENGINE_SETTINGS)):
        table = raw.get(group, {})
        if not isinstance(table, dict):
            raise _err(path, name, group, f"[{group}] must be a table")
        for key in table:
            if key not in allowed:
                raise _err(path, name, f"{group}.{key}", f"unknown setting; [{group}] may set {list(allowed)}")
    try:
        decl = ArmDecl(name=name, **{k: v for k, v in raw.items() if k in ArmDecl.model_fields and k != "name"},
                       campaign={k: raw[k] for k in CAMPAIGN_SETTINGS if k in raw})
    except ValidationError as e:
        first = e.errors()[0]
        raise _err(path, name, ".".join(str(p) for p in first["loc"]), first["msg"]) from None
    _check_values(decl, path)
    return decl


def _check_values(decl: ArmDecl, path: str) -> None:
    """Render and engine values are checked here by their own models (templates' placeholders too)."""
    for group, model in (("render", RenderSpec), ("engine", EngineSpec)):
        try:
            model.model_validate(getattr(decl, group))
        except ValidationError as e:
            first = e.errors()[0]
            raise _err(path, decl.name, f"{group}.{'.'.join(str(p) for p in first['loc'])}", first["msg"]) from None


def _check_kind(arm: ArmDecl, path: str) -> None:
    if arm.kind == "twin" and arm.changes():
        raise _err(path, arm.name, arm.changes()[0], "a twin re-runs the base unchanged; it may set nothing")
    if arm.kind == "placebo":
        for field in arm.changes():
            if field not in PLACEBO_FIELDS:
                raise _err(path, arm.name, field, f"a placebo may change only {list(PLACEBO_FIELDS)}: this setting "
                                                  "changes what is read out or scored; declare it as kind = \"arm\"")
    if arm.kind == "sweep":
        if not arm.parameter:
            raise _err(path, arm.name, "parameter", "a sweep names the parameter it varies")
        if not arm.grid:
            raise _err(path, arm.name, "grid", "a sweep needs a non-empty grid of values")
        if len(set(map(str, arm.grid))) != len(arm.grid):
            raise _err(path, arm.name, "grid", "grid values repeat")
        group, _, key = arm.parameter.partition(".")
        known = (group == "render" and key in RENDER_SETTINGS) or (group == "engine" and key in ENGINE_SETTINGS) \
            or arm.parameter in CAMPAIGN_SETTINGS or arm.parameter == "model"
        if not known:
            raise _err(path, arm.name, "parameter", f"'{arm.parameter}' is not a setting an arm may vary "
                                                    f"({list(CAMPAIGN_SETTINGS)}, render.X, engine.X, model)")
        for _, point in arm.points():
            _check_values(point, path)
    elif arm.parameter or arm.grid:
        raise _err(path, arm.name, "grid" if arm.grid else "parameter", "only a sweep arm has a parameter and grid")


def parse_arms(text: str, *, path: str = "arms.toml") -> ArmsFile:
    """Parse and validate an arms file's text; raises `InputError` naming the arm and the field."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"not valid TOML: {e}", file=path) from None
    unknown = set(doc) - {"name", "base", "gate", "arms"}
    if unknown:
        raise InputError(f"unknown table(s) {sorted(unknown)}; an arms file has name, [base], [gate], [[arms]]",
                         file=path, field=sorted(unknown)[0])
    base = _decl({**doc.get("base", {}), "name": "base"}, path=path, where="base")
    if base.kind != "arm" or base.parameter or base.grid:
        raise _err(path, "base", "kind", "the base is not an arm kind; it takes settings only")
    raw_arms = doc.get("arms", [])
    if not isinstance(raw_arms, list) or not raw_arms:
        raise InputError("no [[arms]]: declare at least one arm", file=path, field="arms")
    arms: list[ArmDecl] = []
    for i, raw in enumerate(raw_arms):
        if "name" not in raw:
            raise InputError(f"arm #{i + 1} has no name", file=path, row=i + 1, field="name")
        decl = _decl(raw, path=path, where=str(raw["name"]))
        if decl.name == "base" or any(a.name == decl.name for a in arms):
            raise _err(path, decl.name, "name", "duplicate arm name (names are unique, and 'base' is the base)")
        _check_kind(decl, path)
        arms.append(decl)
    try:
        test = ExperimentTestSettings.model_validate(doc.get("gate", {}))
    except ValidationError as e:
        first = e.errors()[0]
        raise InputError(first["msg"], file=path, field="gate." + ".".join(str(p) for p in first["loc"])) from None
    placebos = [a.name for a in arms if a.kind in ("placebo", "twin")]
    if test.placebo is None and len([a for a in arms if a.kind == "placebo"]) == 1:
        test = test.model_copy(update={"placebo": next(a.name for a in arms if a.kind == "placebo")})
    if test.placebo is not None and test.placebo not in placebos:
        raise InputError(f"[gate] placebo '{test.placebo}' is not a placebo or twin arm ({placebos})", file=path,
                         field="gate.placebo")
    for a in arms:
        if a.placebo is not None and a.placebo not in placebos:
            raise _err(path, a.name, "placebo", f"'{a.placebo}' is not a placebo or twin arm ({placebos})")
    return ArmsFile(path=path, sha256=sha256_bytes(text.encode()), name=doc.get("name", "experiment"),
                    base=base, test=test, arms=tuple(arms))
