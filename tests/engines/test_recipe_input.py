"""Bad input gets one clear line naming file, key and expectation, exit 2, no traceback."""

import textwrap

import pytest
from helpers import assert_one_clear_line

from ptops.recipes.schema import RecipeError, load, parse_override

GOOD = """
name = "t"
engine = "titan"
[train]
steps = 5
"""


def write(tmp_path, text, name="r.toml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_missing_recipe_file(ptops, tmp_path):
    proc = ptops("launch", str(tmp_path / "nope.toml"), "--dry-run")
    assert_one_clear_line(proc, "nope.toml", "not found")


def test_unknown_key(ptops, tmp_path):
    p = write(tmp_path, GOOD + "[checkpoint]\nintervall = 3\n")
    assert_one_clear_line(
        ptops("launch", str(p), "--dry-run"), str(p), "checkpoint.intervall", "unknown key"
    )


def test_wrong_type(ptops, tmp_path):
    p = write(tmp_path, GOOD.replace("steps = 5", 'steps = "many"'))
    assert_one_clear_line(ptops("launch", str(p), "--dry-run"), str(p), "train.steps", "integer")


def test_unknown_engine(ptops, tmp_path):
    p = write(tmp_path, GOOD.replace('"titan"', '"megatron"'))
    assert_one_clear_line(
        ptops("launch", str(p), "--dry-run"), str(p), "engine", "megatron", '"titan" or "trl"'
    )


def test_bad_set_syntax(ptops, tmp_path):
    p = write(tmp_path, GOOD)
    assert_one_clear_line(
        ptops("launch", str(p), "--set", "train.steps", "--dry-run"), "train.steps", "KEY=VALUE"
    )


def test_set_unknown_key_names_key(ptops, tmp_path):
    p = write(tmp_path, GOOD)
    assert_one_clear_line(
        ptops("launch", str(p), "--set", "train.stepz=3", "--dry-run"), "train.stepz", "unknown key"
    )


def test_invalid_toml(ptops, tmp_path):
    p = write(tmp_path, "name = \n")
    assert_one_clear_line(ptops("launch", str(p), "--dry-run"), str(p), "not valid TOML")


def test_set_overrides_and_types(tmp_path):
    p = write(tmp_path, GOOD)
    rec, _ = load(
        p, ["train.steps=30", "checkpoint.interval=4", "titan.parallelism.tp=2", "titan.lr=1e-3"]
    )
    assert rec.train.steps == 30 and rec.checkpoint.interval == 4
    assert rec.titan.parallelism.tp == 2 and rec.titan.lr == 1e-3


def test_parse_override_values():
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a.b=true") == ("a.b", True)
    assert parse_override("a.b=hello") == ("a.b", "hello")
    with pytest.raises(RecipeError):
        parse_override("=3")


def test_section_of_other_engine_rejected(tmp_path):
    p = write(tmp_path, GOOD + '[trl]\ntrainer = "sft"\n')
    with pytest.raises(RecipeError, match="trl"):
        load(p)


@pytest.mark.titan  # the titan dry run builds TorchTitan's model
def test_dry_run_prints_resolved_recipe(ptops, tmp_path):
    p = write(tmp_path, GOOD)
    proc = ptops("launch", str(p), "--dry-run", "--set", "launch.nproc=3")
    assert proc.returncode == 0, proc.stderr
    assert '"nproc": 3' in proc.stdout
    assert "--nproc-per-node 3" in proc.stdout
    assert "ptops.ops.rank.entry" in proc.stdout


def test_resume_with_different_recipe_refused(ptops, tmp_path):
    from ptops.ops.supervisor.launcher import prepare_run

    p = write(tmp_path, GOOD)
    rec, path = load(p)
    prepare_run(rec, path, tmp_path / "run")
    rec2, _ = load(p, ["train.steps=9"])
    with pytest.raises(RecipeError, match="train.steps"):
        prepare_run(rec2, path, tmp_path / "run")
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700


def test_resume_may_retune_watchdogs_and_records_it(tmp_path):
    from ptops.ops.runrecord.rundir import RunDir
    from ptops.ops.supervisor.launcher import prepare_run
    from ptops.recipes.schema import from_json

    p = write(tmp_path, GOOD)
    rec, path = load(p)
    prepare_run(rec, path, tmp_path / "run")
    rec2, _ = load(p, ["supervisor.hang.floor_s=7"])
    run = prepare_run(rec2, path, tmp_path / "run")
    assert from_json(run.recipe_json.read_text()).supervisor.hang.floor_s == 7
    assert [e["kind"] for e in RunDir(tmp_path / "run").read_events()] == ["recipe_updated"]


# a recipe of the engine every install has (the version matrix runs this module without TorchTitan:
# a titan recipe there stops at the missing engine, exit 4, before the run directory's lock)
SCRIPT = """
name = "s"
engine = "script"
[script]
command = ["python", "-c", "pass"]
"""


def test_second_launcher_on_same_run_dir_refused(ptops, tmp_path):
    from ptops.ops.runrecord.lock import acquire, release
    from ptops.ops.supervisor.launcher import prepare_run

    p = write(tmp_path, SCRIPT)
    rec, path = load(p)
    prepare_run(rec, path, tmp_path / "run")
    fd = acquire(tmp_path / "run")
    try:
        proc = ptops("launch", str(p), "--run-dir", str(tmp_path / "run"))
    finally:
        release(fd)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")


def test_grpo_generations_must_divide_the_batch(ptops):
    proc = ptops("launch", "trl-grpo-tiny", "--set", "trl.num_generations=3", "--dry-run")
    assert_one_clear_line(proc, "trl-grpo-tiny.toml", "trl.num_generations", "must divide", "got 3")


@pytest.mark.parametrize(
    "old,new",
    [
        ("hang_floor_s", "supervisor.hang.floor_s"),
        ("unresponsive_s", "supervisor.hang.ping_stale_s"),
        ("startup_timeout_s", "supervisor.hang.startup_s"),
        ("max_restarts", "supervisor.restart.max_restarts"),
        ("storm_window_min", "supervisor.restart.storm_window_min"),
    ],
)
def test_old_flat_supervisor_key_names_its_new_place(ptops, tmp_path, old, new):
    p = write(tmp_path, GOOD + f"[supervisor]\n{old} = 5\n")
    assert_one_clear_line(
        ptops("launch", str(p), "--dry-run"), str(p), f"key 'supervisor.{old}': moved to '{new}'"
    )


def test_old_flat_supervisor_key_in_set(ptops, tmp_path):
    p = write(tmp_path, GOOD)
    proc = ptops("launch", str(p), "--set", "supervisor.backoff_s=0.5", "--dry-run")
    assert_one_clear_line(
        proc, "--set supervisor.backoff_s=0.5", "moved to 'supervisor.restart.backoff_s'"
    )


def test_nested_supervisor_keys_in_toml(tmp_path):
    p = write(
        tmp_path, GOOD + "[supervisor.hang]\nfloor_s = 7\n[supervisor.restart]\nbackoff_s = 0.25\n"
    )
    rec, _ = load(p)
    assert rec.supervisor.hang.floor_s == 7 and rec.supervisor.restart.backoff_s == 0.25
    assert (
        rec.supervisor.hang.multiplier == 10.0 and rec.supervisor.restart.max_restarts == 10
    )  # defaults kept
    with pytest.raises(RecipeError, match=r"key 'supervisor.hang.total_steps': not a recipe key"):
        load(p, ["supervisor.hang.total_steps=3"])


def test_run_directory_of_the_flat_spelling_still_resumes(tmp_path):
    """recipe.json written before the keys moved: read as the nested form (no error on resume)."""
    import json

    from ptops.ops.supervisor.launcher import prepare_run
    from ptops.recipes.schema import dump_json, from_json

    p = write(tmp_path, GOOD)
    rec, path = load(p)
    run = prepare_run(rec, path, tmp_path / "run")
    old = json.loads(dump_json(rec))
    sup = old["supervisor"]
    sup.pop("hang"), sup.pop("restart")
    sup.update({"hang_floor_s": 5.0, "max_restarts": 2, "unresponsive_s": 3.0})
    run.recipe_json.write_text(json.dumps(old))
    back = from_json(run.recipe_json.read_text())
    assert back.supervisor.hang.floor_s == 5 and back.supervisor.restart.max_restarts == 2
    assert back.supervisor.hang.ping_stale_s == 3
    prepare_run(rec, path, tmp_path / "run")  # same recipe apart from the watchdogs: resumes


def test_a_union_value_is_one_line_naming_every_accepted_form(ptops, tmp_path):
    p = write(tmp_path, GOOD)
    proc = ptops("launch", str(p), "--dry-run", "--set", "supervisor.restart.warm_spare=maybe")
    assert_one_clear_line(
        proc, str(p), "key 'supervisor.restart.warm_spare':", "a valid boolean or 'auto'", '"maybe"'
    )


def test_warm_spare_auto_wants_the_cores_for_the_pool(tmp_path):
    """``auto`` (the default): a pool only where its import does not compete with the ranks."""
    rec, _ = load(write(tmp_path, GOOD))
    restart = rec.supervisor.restart
    assert restart.warm_spare == "auto"
    assert not restart.warm_pool_wanted(2, 2) and not restart.warm_pool_wanted(8, 16)
    assert restart.warm_pool_wanted(2, 6) and restart.warm_pool_wanted(8, 96)
    forced, _ = load(write(tmp_path, GOOD), ["supervisor.restart.warm_spare=true"])
    assert forced.supervisor.restart.warm_pool_wanted(8, 2)
