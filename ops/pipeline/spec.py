"""The pipeline file: stages, their recipes, overrides, inputs and gates; validated before anything
runs.

```toml
name = "post-train"

[[stage]]
name = "sft"
recipe = "trl-sft-tiny"            # a shipped recipe, or a path relative to this file
set = ["train.steps=40", "eval.interval=10"]
gate = { metric = "eval/heldout", op = ">=", value = 0.3 }

[[stage]]
name = "dpo"
recipe = "trl-dpo-tiny"
input = "sft"                      # starts from sft's verified final checkpoint (train.init_from)
faults = ["crash:rank=1,step=4"]   # drills: --fault specs of this stage's launch

[[stage]]
name = "distill"
recipe = "trl-gkd-tiny"
input = "sft"
set = ["trl.teacher={checkpoint:dpo}"]   # any earlier stage's verified final checkpoint as a value
```

Errors are one line naming the file, the key and what was expected (the CLI exits 2).
"""

from __future__ import annotations

import json
import operator
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ptops.recipes.schema import RecipeError, resolve_path
from ptops.recipes.schema import load as load_recipe

OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}


class PipelineError(Exception):
    """One clear line about a bad pipeline file (exit 2)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Gate(_Strict):
    metric: str = Field(
        ...,
        min_length=1,
        description="a metrics.jsonl key, e.g. eval/heldout (rank 0, latest step that has it)",
    )
    op: Literal[">=", ">", "<=", "<", "=="] = ">="
    value: float

    def passes(self, got: float) -> bool:
        return bool(OPS[self.op](got, self.value))

    def text(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}"


class Sampling(_Strict):
    """``kind = "rejection-sampling"``: generate ``n`` answers per prompt from the input, keep the
    best by the verifier."""

    n: int = Field(4, ge=2, le=64, description="samples per prompt")
    prompts: int = Field(64, ge=1, le=100000)
    seed: int = 0
    min_score: float = Field(
        0.0,
        ge=0,
        le=1,
        description="keep a prompt's best answer only at or above this verifier score",
    )
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0)

    def argv(self) -> list[str]:
        return [
            "--n",
            str(self.n),
            "--prompts",
            str(self.prompts),
            "--seed",
            str(self.seed),
            "--min-score",
            str(self.min_score),
            "--max-new-tokens",
            str(self.max_new_tokens),
            "--temperature",
            str(self.temperature),
        ]


class Stage(_Strict):
    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9_-]{0,39}$")
    kind: Literal["train", "rejection-sampling"] = Field(
        "train",
        description="train: a launch of the recipe; rejection-sampling: sample from the input, "
        "keep the best "
        "by the verifier, then the (SFT) recipe trains on the kept rows",
    )
    sampling: Sampling = Sampling()
    recipe: str = Field(..., min_length=1)
    set: list[str] = Field([], description="--set overrides of the stage's launch")
    faults: list[str] = Field([], description="--fault specs of the stage's launch (drills)")
    input: str | None = Field(
        None, description="an earlier stage whose verified final checkpoint this stage starts from"
    )
    gate: Gate | None = None


class Pipeline(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    description: str = ""
    stage: list[Stage] = Field(..., min_length=1)


class Resolved:
    """A validated pipeline: the file's model plus each stage's recipe path and loaded recipe."""

    def __init__(self, path: Path, model: Pipeline, recipes: dict[str, Path], loaded: dict) -> None:
        self.path = path
        self.model = model
        self.recipe_paths = recipes
        self.recipes = loaded

    @property
    def stages(self) -> list[Stage]:
        return self.model.stage

    def stage_dir_name(self, i: int) -> str:
        return f"{i + 1:02d}-{self.stages[i].name}"

    def snapshot(self) -> dict:
        """What pipeline.json keeps: a rerun must be the same pipeline (faults aside: drills
        end)."""
        return {
            "name": self.model.name,
            "file": str(self.path),
            "stages": [
                {
                    "name": s.name,
                    "kind": s.kind,
                    "recipe": str(self.recipe_paths[s.name]),
                    "set": list(s.set),
                    "input": s.input,
                    "sampling": s.sampling.model_dump() if s.kind == "rejection-sampling" else None,
                    "gate": s.gate.model_dump() if s.gate else None,
                    "dir": self.stage_dir_name(i),
                    "steps": self.recipes[s.name].train.steps,
                }
                for i, s in enumerate(self.stages)
            ],
        }


_REF = re.compile(r"\{checkpoint:([^{}]*)\}")


def refs(override: str) -> list[str]:
    """Stage names an override refers to as ``{checkpoint:NAME}``."""
    return _REF.findall(override)


def expand(override: str, checkpoints: dict[str, str], where: str = "set") -> str:
    """``trl.teacher={checkpoint:sft}`` -> ``trl.teacher=/.../checkpoint-40``: another earlier
    stage's verified final checkpoint as a recipe value (a distillation teacher, a reward model),
    besides ``input``."""

    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in checkpoints:
            raise PipelineError(
                f"{where}: {{checkpoint:{name}}} does not name an earlier stage (expected one of: "
                f"{', '.join(sorted(checkpoints)) or 'none'})"
            )
        return checkpoints[name]

    return _REF.sub(sub, override)


def _explain(e: ValidationError, origin: str) -> PipelineError:
    err = e.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return PipelineError(f"{origin}: key '{key}': unknown key")
    if err["type"] == "missing":
        return PipelineError(f"{origin}: key '{key}': missing (required)")
    return PipelineError(
        f"{origin}: key '{key}': {err['msg'].lower()} (got "
        f"{json.dumps(err.get('input'), default=str)})"
    )


def load(path: str | Path) -> Resolved:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise PipelineError(f"{p}: cannot read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise PipelineError(f"{p}: not valid TOML ({e})") from None
    try:
        model = Pipeline.model_validate(data)
    except ValidationError as e:
        raise _explain(e, str(p)) from None
    seen: set[str] = set()
    paths: dict[str, Path] = {}
    loaded: dict = {}
    for i, s in enumerate(model.stage):
        where = f"{p}: key 'stage.{i}"
        if s.name in seen:
            raise PipelineError(f"{where}.name': stage name {s.name!r} used twice")
        if s.input is not None and s.input not in seen:
            raise PipelineError(
                f"{where}.input': {s.input!r} is not an earlier stage (expected one of: "
                f"{', '.join(sorted(seen)) or 'none: the first stage has no input'})"
            )
        seen.add(s.name)
        local = p.parent / s.recipe
        try:
            rpath = local.resolve() if local.is_file() else resolve_path(s.recipe).resolve()
            overrides = [expand(o, {n: f"/({n})" for n in seen}, f"{where}.set'") for o in s.set]
            if (
                s.input is not None
            ):  # the real path is set at run time; checks the engine supports it
                if any(o.split("=", 1)[0].strip() == "train.init_from" for o in overrides):
                    raise PipelineError(
                        f"{where}.set': train.init_from is set by `input` (remove it)"
                    )
                overrides.append("train.init_from=(input)")
            if s.kind == "rejection-sampling":
                if s.input is None:
                    raise PipelineError(
                        f"{where}.input': a rejection-sampling stage samples from an earlier "
                        "stage's checkpoint (set input)"
                    )
                overrides.append("train.data_file=(rejection-sampling)")
            rec, _ = load_recipe(rpath, overrides)
        except RecipeError as e:
            raise PipelineError(f"{where}' (stage {s.name}): {e}") from None
        if s.kind == "rejection-sampling" and (rec.engine != "trl" or rec.trl.trainer != "sft"):
            raise PipelineError(
                f"{where}.recipe': a rejection-sampling stage fine-tunes with an SFT recipe "
                f'(trl trainer "sft"), got {rec.engine} '
                f"{getattr(rec.engine_section(), 'trainer', '')}".rstrip()
            )
        if s.gate is not None and s.gate.metric.startswith("eval/") and not rec.eval.interval:
            raise PipelineError(
                f"{where}.gate.metric': {s.gate.metric} needs a held-out eval in the stage's "
                "recipe "
                f"(set eval.interval=N in the recipe or in `set`)"
            )
        if s.faults:
            from ptops.faultinject.spec import FaultSpecError, parse_all

            try:
                parse_all(s.faults)
            except FaultSpecError as e:
                raise PipelineError(f"{where}.faults': {e}") from None
        paths[s.name] = rpath
        loaded[s.name] = rec
    return Resolved(p.resolve(), model, paths, loaded)
