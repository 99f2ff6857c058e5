"""Recipe files: TOML, validated by a schema, overridable with ``--set KEY=VALUE``.

Errors are raised as :class:`RecipeError` with one line that names the file, the
key and what was expected, because the person reading it is usually tired.
Engine sections (``[titan]``, ``[trl]``) are validated by the engine's own
model, which lives beside the engine adapter but imports no torch; engines register
themselves (:mod:`ptops.recipes.engines`), and ``Recipe`` gets one optional field per engine.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from ptops.monitors import MonitorConfigError, build_monitors
from ptops.monitors.config import MonitorsSection
from ptops.monitors.hang import HangConfig
from ptops.recipes import engines as _engines

RECIPES_DIR = Path(__file__).resolve().parent


class RecipeError(Exception):
    """One clear line about a bad recipe or override; the CLI exits 2 with it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrainSection(_Strict):
    steps: int = Field(20, ge=1, description="optimizer steps in the whole run")
    seed: int = Field(42, description="seed for model init, data order and dropout")
    data_file: str = Field(
        "",
        description='SFT: train on these chat rows (JSONL of {"messages": [...]}) instead of the '
        "built-in set "
        "(a rejection-sampling pipeline stage writes it)",
    )
    init_from: str = Field(
        "",
        description="start from these weights (a checkpoint folder, or a run directory meaning "
        "its latest good "
        "checkpoint; verified first): weights only, before step 0 - a fresh optimizer, schedule "
        "and step count "
        "(TRL and TorchTitan recipes; a pipeline stage's input). A resumed run continues from "
        "its own checkpoint instead",
    )


class LaunchSection(_Strict):
    nproc: int = Field(2, ge=1, le=64, description="ranks per node (torchrun --nproc-per-node)")
    omp_num_threads: int = Field(1, ge=1, description="OMP_NUM_THREADS for each rank")
    master_port: int = Field(0, ge=0, le=65535, description="rendezvous port; 0 picks a free one")


class CheckpointSection(_Strict):
    interval: int = Field(10, ge=1, description="save every N steps (and always at the final step)")
    keep: int = Field(3, ge=1, description="keep the newest K checkpoints")


class EvalSection(_Strict):
    """``[eval]``: a held-out evaluation in the training loop; results are ``eval/<name>`` keys on
    the step's metrics record (monitors, alerts, exporters and pipeline gates read them)."""

    set: Literal["arithmetic"] = Field(
        "arithmetic",
        description="the held-out set: `arithmetic` (questions none of the recipe's training sets "
        "holds, greedy answers graded by the verifier)",
    )
    name: str = Field(
        "heldout", pattern=r"^[A-Za-z0-9_]+$", description="the record key is eval/<name>"
    )
    interval: int = Field(
        0, ge=0, description="evaluate every N steps and at the final step; 0 = off"
    )
    size: int = Field(16, ge=1, le=1024, description="held-out examples per evaluation")
    max_new_tokens: int = Field(8, ge=1, description="greedy tokens generated per example")


class RestartConfig(_Strict):
    """``[supervisor.restart]``: when a failed attempt (crash, hang, early exit) is restarted, and
    when not."""

    max_restarts: int = Field(
        10, ge=0, description="restarts in the whole run (across supervisors); then stop (exit 1)"
    )
    backoff_s: float = Field(
        1.0,
        ge=0,
        description="delay before restarting an attempt that made no progress (newer good "
        "checkpoint); doubles with each such attempt in a row (an attempt that made progress "
        "restarts at once)",
    )
    backoff_max_s: float = Field(60.0, ge=0, description="longest delay before a restart")
    storm_restarts: int = Field(
        5,
        ge=1,
        description="this many failures within storm_window_min is a restart storm (exit 3)",
    )
    storm_window_min: float = Field(
        10.0, gt=0, description="window of the restart-storm rule, minutes"
    )
    no_progress_attempts: int = Field(
        3,
        ge=1,
        description="stop (exit 3) after this many attempts in a row without progress: no newer "
        "good checkpoint (or save of a script's own), and no step beyond what earlier attempts "
        "reached",
    )
    warm_spare: bool | Literal["auto"] = Field(
        "auto",
        description="keep a warm pool (one process that imports the engine alongside the first "
        "attempt's "
        "ranks); a restart's ranks are forked from it, without a new torchrun, instead of "
        "importing torch "
        "and the engine again (a restart that finds it still importing waits for it; the launch "
        "event says "
        "ranks_from warm or cold, and why) (ops/rank/warm.py, warmlaunch.py); TorchTitan imports "
        "everything "
        "ahead, other engines torch only. `auto`: on when the machine has the cores for it (at "
        "least 2 x "
        "launch.nproc + 2: the pool's import then does not slow the first attempt), off on small "
        "boxes and under Slurm",
    )

    def warm_pool_wanted(self, nproc: int, cpus: int | None) -> bool:
        """``warm_spare`` resolved for a machine with ``cpus`` cores running ``nproc`` ranks."""
        if self.warm_spare == "auto":
            return (cpus or 1) >= 2 * nproc + 2
        return bool(self.warm_spare)


class HealthConfig(_Strict):
    """``[supervisor.health]``: checks before attempt 1 and each restart (supervisor/health.py)."""

    enabled: bool = Field(True, description="false = no checks before attempts")
    min_free_mb: float = Field(
        1024.0,
        ge=0,
        description="free space the checkpoint directory needs (and twice the newest checkpoint)",
    )
    # the names of ops/supervisor/health.py's CHECKS (tests/supervisor/test_health.py keeps the two
    # equal)
    skip: list[
        Literal[
            "checkpoint_space", "checkpoint_writable", "rendezvous", "gpus", "gpu_xid", "clock_skew"
        ]
    ] = Field(default_factory=list, description="names of checks not to run")
    rendezvous_timeout_s: float = Field(
        2.0,
        gt=0,
        description="how long resolving a rendezvous address (or a clock answer) may take",
    )
    max_clock_skew_s: float = Field(
        1.0,
        gt=0,
        description="multi-node: how far a node's clock may be from the supervisor's (events of "
        "every node land on one timeline)",
    )
    node_timeout_s: float = Field(
        60.0,
        gt=0,
        description="multi-node: how long the check step on every node may take; a node without "
        "a report by then fails",
    )


class SupervisorSection(_Strict):
    """``[supervisor]``: how ``ptops launch`` watches (and, with ``--supervise``, restarts) a run
    (all optional)."""

    channel_host: str = Field(
        "127.0.0.1",
        description="address the supervisor's channel listens on (0.0.0.0 for multi-node)",
    )
    channel_port: int = Field(0, ge=0, le=65535, description="channel port; 0 picks a free one")
    channel_advertise: str = Field(
        "",
        description="host name ranks connect to; empty = channel_host (its hostname for 0.0.0.0)",
    )
    heartbeat_s: float = Field(
        1.0, gt=0, description="rank liveness ping interval (keep well below hang.ping_stale_s)"
    )
    stack_timeout_s: float = Field(
        5.0,
        gt=0,
        description="wait this long for a rank to send its stacks before using py-spy / "
        "faulthandler",
    )
    grace_s: float = Field(
        30.0,
        ge=0,
        description="Ctrl-C / SIGTERM: time the ranks get to checkpoint (engines that support "
        "it) before they are stopped",
    )
    kill_timeout_s: float = Field(
        10.0, gt=0, description="SIGTERM to SIGKILL escalation when tearing an attempt down"
    )
    metrics_rotate_mb: float = Field(
        256.0,
        ge=0,
        description="metrics.jsonl past this size (MB) moves to the next metrics/NNNNNN.jsonl "
        "segment, described in metrics/index.jsonl (0: never rotate; docs/scale.md)",
    )
    metrics_lines: Literal["rank", "node"] = Field(
        "rank",
        description="metrics.jsonl: a line per rank per step (rank), or a line per node batch "
        "(node: each rank's keys that differ from its node's first record; every ptops reader "
        "expands it to the same records; for thousands of nodes: docs/scale.md)",
    )
    metrics_rank_detail_every: int = Field(
        1,
        ge=1,
        description='with metrics_lines = "node": each rank\'s keys in metrics.jsonl every this '
        "many steps; between, a node's routine ranks (not rank 0, finite numbers) as one summary "
        "(their min, median, max); the monitors still read every record live (docs/scale.md)",
    )
    node_summaries: bool = Field(
        False,
        description="with metrics_rank_detail_every > 1: the node agents sum up their routine "
        "ranks between samples on the wire, so the supervisor's work a step grows with nodes, "
        "not ranks; the straggler and memory monitors then see those ranks on sample steps only "
        "(docs/scale.md)",
    )
    restart: RestartConfig = Field(
        RestartConfig(), description="restart policy (``ptops launch --supervise`` only)"
    )
    hang: HangConfig = Field(HangConfig(), description="hang budgets (monitors/hang.py)")
    health: HealthConfig = Field(HealthConfig(), description="health checks before each attempt")


class SlurmSection(_Strict):
    """``[slurm]``: how ``ptops launch --supervise --slurm`` asks Slurm for nodes (CLI flags
    override)."""

    nodes: int = Field(
        1, ge=1, le=4096, description="nodes the ranks run on (launch.nproc ranks per node)"
    )
    gpus_per_node: int = Field(
        0,
        ge=0,
        le=64,
        description="GPUs per node (--gpus-per-node; sets launch.nproc); 0: no GPU request",
    )
    spare_nodes: int = Field(
        0,
        ge=0,
        le=64,
        description="extra nodes held in the allocation to replace blamed nodes without requeueing",
    )
    partition: str = Field("", description="--partition; empty: the cluster's default")
    time: str = Field("", description="--time (e.g. 04:00:00); empty: the partition's default")
    account: str = Field("", description="--account")
    qos: str = Field("", description="--qos")
    signal_s: int = Field(
        120,
        ge=10,
        description="--signal=B:USR1@S: seconds before the time limit the supervisor is warned "
        "(save, then requeue)",
    )
    exclude: list[str] = Field(default_factory=list, description="nodes never to use (--exclude)")
    node_strikes: int = Field(
        2,
        ge=1,
        description="failed attempts blamed on one node before it is replaced by a spare (or the "
        "job requeued without it)",
    )
    preempt_grace_s: float = Field(
        60.0,
        gt=0,
        description="on the warning signal: how long the ranks get to save before the requeue",
    )
    upstream_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a node agent kills its ranks when it hears nothing from the supervisor this "
        "long (a cut link)",
    )
    relay_every: int = Field(
        0,
        ge=0,
        le=4096,
        description="nodes a relay (ops/node/relay.py) serves: the first node of each group also "
        "relays the group's agents to the supervisor, so its work grows with relays, not nodes "
        "(docs/scale.md); 0: every agent straight to the supervisor. At thousands of nodes, 64",
    )
    sbatch_args: list[str] = Field(
        default_factory=list, description='extra #SBATCH options, e.g. ["--mem=0"]'
    )


# Flat ``[supervisor]`` keys of earlier versions -> where they live now (one clear line, exit 2).
MOVED_KEYS = {
    "supervisor.hang_multiplier": "supervisor.hang.multiplier",
    "supervisor.hang_floor_s": "supervisor.hang.floor_s",
    "supervisor.hang_window": "supervisor.hang.window",
    "supervisor.startup_timeout_s": "supervisor.hang.startup_s",
    "supervisor.checkpoint_timeout_s": "supervisor.hang.checkpoint_s",
    "supervisor.unresponsive_s": "supervisor.hang.ping_stale_s",
    **{f"supervisor.{k}": f"supervisor.restart.{k}" for k in RestartConfig.model_fields},
}


class RecipeBase(_Strict):
    name: str = Field(..., min_length=1)
    engine: str = Field(..., description="a registered engine (ptops.recipes.engines)")
    description: str = ""
    train: TrainSection = TrainSection()
    launch: LaunchSection = LaunchSection()
    checkpoint: CheckpointSection = CheckpointSection()
    supervisor: SupervisorSection = SupervisorSection()
    monitors: MonitorsSection = MonitorsSection()
    slurm: SlurmSection = SlurmSection()
    eval: EvalSection = EvalSection()

    def engine_section(self) -> Any:
        section = getattr(self, self.engine)
        assert section is not None
        return section


# One optional section per registered engine: [titan], [trl], ... (a plugin cannot take a name of
# the base's)
_engines.reserve(
    {n for n in dir(RecipeBase) if not n.startswith("_")} | set(RecipeBase.model_fields)
)
Recipe = create_model(
    "Recipe",
    __base__=RecipeBase,
    **{name: (Optional[e.section], None) for name, e in _engines.engines().items()},  # type: ignore[call-overload]
)


def resolve_path(recipe: str | Path) -> Path:
    """A path, or the bare name of a shipped recipe (``titan-tiny``, or one an engine plugin
    ships)."""
    p = Path(recipe)
    if p.is_file():
        return p
    shipped = shipped_recipes().get(str(recipe)) if not p.suffix and len(p.parts) == 1 else None
    if shipped is not None:
        return shipped
    raise RecipeError(
        f"{recipe}: recipe file not found (expected a TOML file or one of: "
        f"{', '.join(shipped_names())})"
    )


@dataclass(frozen=True)
class RecipeRef:
    """What every command makes of a RECIPE argument: its short name (run and scenario names) and
    file."""

    name: str
    path: Path


def resolve(recipe: str | Path) -> RecipeRef:
    path = resolve_path(recipe).resolve()
    return RecipeRef(path.stem, path)


def shipped_recipes() -> dict[str, Path]:
    """Recipe name -> file: ptops' own, then each engine's ``recipes_dir`` (a name taken keeps its
    first file)."""
    found: dict[str, Path] = {}
    for folder in (RECIPES_DIR, *_engines.recipe_dirs()):
        for p in sorted(folder.glob("*.toml")):
            found.setdefault(p.stem, p)
    return found


def shipped_names() -> list[str]:
    return sorted(shipped_recipes())


def parse_override(text: str) -> tuple[str, Any]:
    """``train.steps=30`` -> (``train.steps``, 30). Values parse as TOML, else as strings."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part.isidentifier() for part in key.split(".")):
        raise RecipeError(f"--set {text!r}: bad syntax (expected KEY=VALUE, e.g. train.steps=30)")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def _apply(data: dict, key: str, value: Any, origin: str) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"{origin}: key '{key}': '{part}' is a value, not a table")
        node = child
    node[parts[-1]] = value


_UNION_TAGS = {"bool", "int", "float", "str"}


def _union_tag(part: Any) -> bool:
    """A loc element pydantic adds for the member of a union (``bool``, ``literal['auto']``), not a
    key."""
    return str(part) in _UNION_TAGS or str(part).startswith(("literal[", "function-"))


def _explain(exc: ValidationError, origin: str) -> RecipeError:
    errors = exc.errors()
    err = errors[0]
    if len(errors) > 1 and all(
        e["loc"][:-1] == err["loc"][:-1] and _union_tag(e["loc"][-1]) for e in errors
    ):
        # a value of a union (`bool | "auto"`): one line, every accepted form
        wants = [e["msg"].lower().removeprefix("input should be ").split(", ")[0] for e in errors]
        err = {**err, "loc": err["loc"][:-1], "msg": "input should be " + " or ".join(wants)}
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        return RecipeError(f"{origin}: key '{key}': unknown key")
    if kind == "missing":
        return RecipeError(f"{origin}: key '{key}': missing (required)")
    got = err.get("input")
    got_s = (
        " (got "
        f"{json.dumps(got) if isinstance(got, (str, int, float, bool)) else type(got).__name__})"
    )
    return RecipeError(f"{origin}: key '{key}': {err['msg'].lower()}{got_s}")


def load(recipe: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Recipe, Path]:
    """Load, override and validate. Returns the recipe and the file it came from."""
    path = resolve_path(recipe)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML ({e})") from None
    except OSError as e:
        raise RecipeError(f"{path}: cannot read ({e.strerror})") from None
    _check_moved(data, str(path))
    for text in overrides:
        key, value = parse_override(text)
        _apply(data, key, value, f"{path} (--set {text})")
        _check_moved(data, f"{path} (--set {text})")
    return validate(data, str(path)), path


def command_recipe_toml(command: list[str], cwd: str | Path) -> str:
    """The recipe ``ptops launch [options] -- COMMAND...`` runs (engine ``script``), as TOML text:
    the run directory keeps it as ``recipe.toml``, so ``ptops launch RUN/recipe.toml`` runs it
    again."""
    if not command or not command[0].strip():
        raise RecipeError(
            "ptops launch -- COMMAND: the command after -- is empty (e.g. -- python train.py)"
        )
    py = next((a for a in command if a.endswith(".py")), None)
    stem = Path(py).stem if py else Path(command[0]).name
    if py and Path(py).parent.name not in ("", "."):
        stem = f"{Path(py).parent.name}-{stem}"  # examples/fsdp2/train.py -> fsdp2-train
    if "-m" in command[:-1]:
        stem = command[command.index("-m") + 1].rsplit(".", 1)[-1]
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in stem).strip("-.") or "script"
    words = ", ".join(json.dumps(a) for a in command)
    about = json.dumps("ptops launch -- " + " ".join(command))
    return (
        f'name = {json.dumps(name)}\nengine = "script"\ndescription = {about}\n\n'
        f"[script]\ncommand = [{words}]\ncwd = {json.dumps(str(Path(cwd).resolve()))}\n"
    )


def _check_moved(data: dict, origin: str) -> None:
    """An old flat key fails with the key it moved to (instead of a bare "unknown key")."""
    for old, new in MOVED_KEYS.items():
        section, _, key = old.partition(".")
        table = data.get(section)
        if isinstance(table, dict) and key in table:
            raise RecipeError(f"{origin}: key '{old}': moved to '{new}'")


def validate(data: dict, origin: str) -> Recipe:
    registered = _engines.engines()
    engine = data.get("engine")
    if engine not in registered:
        expected = " or ".join(json.dumps(n) for n in registered)
        raise RecipeError(
            f"{origin}: key 'engine': unknown engine {json.dumps(engine)} (expected {expected})"
        )
    _check_moved(data, origin)
    data = dict(data)
    data.setdefault(engine, {})
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise _explain(e, origin) from None
    for other in registered:
        if other != engine and getattr(recipe, other) is not None:
            raise RecipeError(
                f"{origin}: key '{other}': section does not apply to engine \"{engine}\""
            )
    if recipe.supervisor.hang.total_steps is not None:
        raise RecipeError(
            f"{origin}: key 'supervisor.hang.total_steps': not a recipe key (the supervisor sets "
            "it from train.steps)"
        )
    build_monitors_of(
        recipe.monitors, origin
    )  # a [monitors] config no monitor accepts is bad input, not silence
    _check_cross_keys(recipe, origin)
    return recipe


def build_monitors_of(section: MonitorsSection, origin: str) -> list:
    """The monitors of a ``[monitors]`` section, or one :class:`RecipeError` naming the monitor that
    cannot be built."""
    try:
        return build_monitors(section)
    except MonitorConfigError as e:
        raise RecipeError(
            f"{origin}: key 'monitors.{e.monitor}': the monitor cannot be built with these "
            f"settings ({e})"
        ) from None


# keys only some engines implement: engine -> keys (a recipe that sets one elsewhere is bad input,
# not silence)
ENGINE_ONLY = {
    "train.init_from": ("trl", "titan"),
    "eval.interval": ("trl",),
    "train.data_file": ("trl",),
}


def _check_cross_keys(recipe: Recipe, origin: str) -> None:
    """The engine's rules that span sections, caught here rather than as a traceback inside every
    rank."""
    for key, engines in ENGINE_ONLY.items():
        section, _, field = key.partition(".")
        if getattr(getattr(recipe, section), field) and recipe.engine not in engines:
            raise RecipeError(
                f"{origin}: key '{key}': not supported by engine \"{recipe.engine}\" (only "
                f"{', '.join(engines)})"
            )
    sup = recipe.supervisor
    if sup.metrics_rank_detail_every > 1 and sup.metrics_lines != "node":
        raise RecipeError(
            f"{origin}: key 'supervisor.metrics_rank_detail_every': expected 1 unless "
            f'supervisor.metrics_lines = "node" (got {sup.metrics_rank_detail_every} with '
            f'"{sup.metrics_lines}")'
        )
    if sup.node_summaries and sup.metrics_rank_detail_every < 2:
        raise RecipeError(
            f"{origin}: key 'supervisor.node_summaries': expected false unless "
            "supervisor.metrics_rank_detail_every > 1 (the steps every rank is sent whole on; "
            f"got {sup.metrics_rank_detail_every})"
        )
    check = _engines.get(recipe.engine).check
    problem = check(recipe) if check is not None else None
    if problem is not None:
        key, expected = problem
        raise RecipeError(f"{origin}: key '{key}': {expected}")


def dump_json(recipe: Recipe) -> str:
    return recipe.model_dump_json(indent=2, exclude_none=True)


def from_json(text: str, origin: str = "recipe.json") -> Recipe:
    """A run directory's stored recipe, validated as strictly as a TOML file; one written before
    the ``[supervisor]`` keys moved still reads."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise RecipeError(f"{origin}: not valid JSON ({e})") from None
    sup = data.get("supervisor") if isinstance(data, dict) else None
    if isinstance(sup, dict):
        for old, new in MOVED_KEYS.items():
            key = old.partition(".")[2]
            if key in sup:
                _, table, leaf = new.split(".")
                sup.setdefault(table, {})[leaf] = sup.pop(key)
    return validate(data, origin)
