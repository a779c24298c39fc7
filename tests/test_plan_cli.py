"""Plan JSON (round trip, versioning, corrupt files, atomic save, reuse) and the command line."""
import json

import jax
import pytest

import autopar
from autopar.cli import main
from models import assert_tree_close, make


@pytest.fixture(scope="module")
def planned():
    step, state, batch = make("mlp", "sgd")
    pstep = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(2, 4)))
    return step, state, batch, pstep.get_plan(state, batch)


def test_plan_json_round_trip(planned, tmp_path):
    *_, plan = planned
    again = autopar.Plan.from_json(plan.to_json())
    assert again == plan
    path = tmp_path / "p.json"
    plan.save(path)
    assert autopar.Plan.load(path) == plan
    assert json.loads(path.read_text())["schema_version"] == 2
    text = plan.summary()
    assert "2x4" in text and "args[0]" in text


@pytest.mark.parametrize("content,match", [("{not json", "invalid JSON"), ('{"a": 1}', "not an autopar plan"),
                                           ('{"schema_version": 99, "stages": []}', "schema_version 99"),
                                           ('{"schema_version": "2", "stages": []}', "schema_version '2'.*integer"),
                                           ('{"schema_version": 2, "stages": [{"x": 1}]}', "corrupt")])
def test_bad_plan_files_give_clear_errors(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(autopar.PlanFileError, match=match):
        autopar.Plan.load(path)
    with pytest.raises(autopar.PlanFileError, match="cannot read"):
        autopar.Plan.load(tmp_path / "missing.json")


def test_failed_save_never_overwrites_a_good_plan(planned, tmp_path):
    *_, plan = planned
    path = tmp_path / "p.json"
    plan.save(path)
    good = path.read_bytes()
    broken = autopar.Plan(**{**plan.__dict__, "cluster": {"bad": object()}})
    with pytest.raises(TypeError):
        broken.save(path)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_saved_plan_is_reused_without_planning(planned, tmp_path):
    step, state, batch, plan = planned
    path = tmp_path / "p.json"
    plan.save(path)
    reused = autopar.parallelize(step, plan=str(path))
    assert reused.get_plan(state, batch) == plan
    (p1, _), loss = reused(state, batch)
    (p2, _), ref = jax.jit(step)(state, batch)
    assert_tree_close(loss, ref)
    assert_tree_close(p1, p2)
    other = jax.tree_util.tree_map(lambda x: x[:8], batch)
    with pytest.raises(autopar.PlanFileError, match="different signature"):
        reused.get_plan(state, other)


def test_cli_inspect(planned, tmp_path, capsys):
    *_, plan = planned
    path = tmp_path / "p.json"
    plan.save(path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2x4" in out and "predicted" in out
    (tmp_path / "bad.json").write_text("{")
    assert main(["inspect", str(tmp_path / "bad.json")]) == 2
    assert "invalid JSON" in capsys.readouterr().err


def test_cli_plan_for_a_cluster_that_is_not_here(tmp_path, capsys):
    out = tmp_path / "gpt.json"
    rc = main(["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "16", "--batch", "8",
               "--vocab", "128", "--cluster", "2x8:a100-80g", "--out", str(out)])
    assert rc == 0
    plan = autopar.Plan.load(out)
    assert len(plan.stages[0].device_ids) == 16
    assert plan.stages[0].mesh_shape[0] * plan.stages[0].mesh_shape[1] == 16
    assert main(["plan", "--cluster", "3x:nonsense"]) == 2


def test_cli_demo_runs_and_checks_against_one_device(capsys, tmp_path):
    rc = main(["demo", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "8", "--batch", "8",
               "--vocab", "64", "--out", str(tmp_path / "demo.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "same result as one device" in out
    assert autopar.Plan.load(tmp_path / "demo.json").stages[0].mesh_shape in [(1, 8), (2, 4), (4, 2), (8, 1)]


def test_cli_plans_token_slices_for_a_v100_cluster(tmp_path, capsys):
    out = tmp_path / "tp.json"
    rc = main(["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "64", "--batch", "2",
               "--vocab", "128", "--cluster", "2x8:v100-16g", "--method", "pipeshard", "--micro-batches", "1",
               "--stages", "2", "--token-slices", "auto", "--out", str(out)])
    assert rc == 0
    assert "token slices (TeraPipe, 64 tokens, model slice times)" in capsys.readouterr().out
    ts = autopar.Plan.load(out).pipeline.token_slices
    assert sum(ts.micro_batch_sizes) == 2 and all(sum(s) == 64 for s in ts.slices)
    assert main(["plan", "--method", "pipeshard", "--token-slices", "3,x"]) == 2
    assert main(["plan", "--token-slices", "4"]) == 2          # not a pipeline
