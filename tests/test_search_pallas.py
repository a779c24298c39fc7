"""The Pallas backend (`target="pallas"`): kernels from random schedules of every compute
definition match numpy in interpret mode (including tiles that do not divide the shapes), the
plan maps tiling to grid and BlockSpecs, the GPU sketch rules hold, tuning without a GPU
records checked-but-untimed kernels that never win on latency, and the cost model keeps
backends apart."""
import math
import random

import numpy as np
import pytest

from cost_model import XGBoostCostModel
from cost_model.features import PALLAS_FEATURES, feature_matrix, program_vector
from search import Task, best_schedule, build, tune
from search.codegen_pallas import program_function
from search.database import TuningDB
from search.features import statement_features
from search.features_pallas import kernel_features
from search.lower import lower
from search.measure import MeasureOptions
from search.measure_pallas import PallasMeasurer, time_runs_s
from search.backend_pallas import PallasBackend
from search.mutation import mutate
from search.pallas_plan import gpu_problem, is_dot, plan
from search.prior_pallas import estimate_s
from search.record import TuningRecord
from search.schedule import replay
from search.sketch import annotate, generate_sketches
from search.sketch_pallas import annotate_pallas, pallas_program, pallas_sketches
from search.tune import chosen_record

# small shapes (interpret mode runs every grid program in Python-traced XLA), most of them with
# extents that power-of-two blocks do not divide
TASKS = {
    "matmul": Task.matmul(12, 20, 8),
    "matmul_dot": Task.matmul(32, 48, 32),       # blocks of 16-32: one step is a tl.dot
    "matmul_relu": Task.matmul(10, 24, 6, epilogue="relu"),
    "batch_matmul": Task.batch_matmul(3, 6, 10, 4),
    "dense_gelu": Task.dense(9, 16, 12, "gelu"),
    "dense_relu": Task.dense(8, 12, 8, "relu"),
    "softmax": Task.softmax(6, 20),
    "layernorm": Task.layernorm(5, 24),
    "conv2d_pad": Task.conv2d(1, 6, 6, 3, 4, 3, 3, 1, 1),
    "conv2d_stride": Task.conv2d(2, 7, 7, 2, 4, 3, 3, 2, 0),
}


def run_interpret(task, steps, seed=1):
    prog = plan(replay(task.dag, steps))
    ins = task.random_inputs(seed)
    out = np.asarray(program_function(prog, interpret=True)(*[ins[n] for n, _ in task.input_shapes]))
    ref = task.reference(ins)
    return float(np.abs(out - ref).max() / np.abs(ref).max()), out.shape == ref.shape


def pallas_schedules(task, seed, per_sketch=2, n_mutants=1):
    rng = random.Random(seed)
    out = []
    for sk in pallas_sketches(task.dag):
        for _ in range(per_sketch):
            s = annotate_pallas(sk, task.dag, rng)
            assert s is not None, f"Pallas sketch {sk.name} of {task} has no valid annotation"
            out.append(s)
    mutants = [m for m in (mutate(task.dag, rng.choice(out), rng) for _ in range(8))
               if m is not None and pallas_program(task.dag, m) is not None]
    return out + mutants[:n_mutants]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_random_pallas_schedules_match_numpy(name):
    task = TASKS[name]
    scheds = pallas_schedules(task, seed=sum(map(ord, name)))
    for s in scheds:
        err, same_shape = run_interpret(task, s)
        assert same_shape and err <= 1e-4, (err, s)


def test_tiles_that_do_not_divide_pad_and_stay_correct():
    """13 x 10 x 6 matmul, blocks 8 x 4 and k steps of 2: a 2 x 3 grid over a 16 x 12 padded
    output; A is padded to 16 rows and read in (8, 6) blocks, B in (6, 4) blocks."""
    task = Task.matmul(13, 10, 6)
    steps = [{"kind": "split", "stage": "C", "iter": "i", "factors": [8]},
             {"kind": "split", "stage": "C", "iter": "j", "factors": [4]},
             {"kind": "split", "stage": "C", "iter": "k", "factors": [2]},
             {"kind": "reorder", "stage": "C", "order": ["i.0", "j.0", "k.0", "i.1", "j.1", "k.1"]}]
    prog = plan(replay(task.dag, steps))
    (k,) = prog.kernels
    assert k.grid == (2, 3) and k.out_padded_shape == (16, 12)
    a, b = sorted(k.reads, key=lambda r: r.name)
    assert (a.name, a.block, a.grid_dims, a.pad) == ("A", (8, 6), (0, None), ((0, 3), (0, 0)))
    assert (b.name, b.block, b.grid_dims, b.pad) == ("B", (6, 4), (None, 1), ((0, 0), (0, 2)))
    assert k.root.reduce_tiles == (2,)  # three steps of the loop inside the kernel
    err, same_shape = run_interpret(task, steps)
    assert same_shape and err <= 1e-5


def test_sampled_pallas_schedules_overhang_their_shapes():
    """The property test is not only run on tiles that divide: among the sampled schedules of
    these odd shapes, most tasks have a kernel whose blocks overhang the output."""
    overhang = 0
    for name, task in TASKS.items():
        progs = [pallas_program(task.dag, s) for s in pallas_schedules(task, seed=sum(map(ord, name)))]
        overhang += any(k.out_padded_shape != prog.stage(k.name).shape for prog in progs for k in prog.kernels)
    assert overhang >= 6


def test_gpu_sketch_rules():
    """Pallas schedules have power-of-two blocks and reduction tiles, no CPU-only steps
    (parallel, vectorize, unroll, packing, cache stages), and keep gpu_problem's rules."""
    cpu_only = {"annotate", "pragma", "cache_read", "cache_write", "rfactor", "fuse"}
    for name, task in TASKS.items():
        rng = random.Random(7)
        for sk in pallas_sketches(task.dag):
            for _ in range(5):
                s = annotate_pallas(sk, task.dag, rng)
                assert not {st["kind"] for st in s} & cpu_only, (name, s)
                for st in s:
                    if st["kind"] == "split":
                        assert all(f & (f - 1) == 0 for f in st["factors"]), (name, st)
                assert gpu_problem(plan(replay(task.dag, s))) is None


def test_cpu_schedules_also_become_correct_pallas_kernels():
    """The codegen takes any schedule: CPU rule schedules (register tiles, cache_write,
    cache_read packing, rfactor, fusion at tile level 2) give correct, if not Triton-legal, kernels."""
    rng = random.Random(3)
    kinds = set()
    for name in ("matmul_relu", "softmax", "conv2d_pad"):
        task = TASKS[name]
        for sk in generate_sketches(task.dag)[:4]:
            s = annotate(sk, task.dag, rng)
            kinds |= {st["kind"] for st in s}
            err, _ = run_interpret(task, s)
            assert err <= 1e-4, (name, sk.name, err)
    assert {"cache_write", "rfactor", "annotate"} <= kinds


def test_gpu_problem_names_a_block_that_is_not_a_power_of_two():
    task = Task.matmul(12, 16, 8)
    steps = [{"kind": "split", "stage": "C", "iter": "i", "factors": [6]}]
    problem = gpu_problem(plan(replay(task.dag, steps)))
    assert problem is not None and "6 elements of axis 'i'" in problem
    assert pallas_program(task.dag, steps) is None


def test_dot_only_for_tiles_tl_dot_takes():
    big = TASKS["matmul_dot"].dag.stage("C")
    assert is_dot(big, {"i": 16, "j": 16, "k": 16})
    assert not is_dot(big, {"i": 8, "j": 16, "k": 16})      # tl.dot needs 16 on every side
    assert not is_dot(Task.softmax(4, 16).dag.stage("T_sum"), {"i": 16, "k": 16})


def tune_and_check(tmp_path, task, trials=4):
    db = str(tmp_path / "pallas.sqlite")
    res = tune(task, target="pallas", trials=trials, batch_size=2, db=db, policy="random")
    return db, res


def test_tune_without_gpu_records_checked_unmeasured_kernels(tmp_path):
    task = TASKS["dense_relu"]
    db, res = tune_and_check(tmp_path, task)
    assert len(res.records) == 4
    for r in res.records:
        assert r.error is None and r.latencies_s == () and r.extra["measured"] is False
        assert r.unmeasured and not r.ok and r.latency_s == math.inf
        assert r.target["backend"] == "pallas" and r.target["model"] == "interpret"
    assert res.best_latency_s == math.inf and res.best_gflops == 0.0
    assert res.best_schedule == res.records[0].schedule  # the first one checked
    with TuningDB(db) as d:
        stored = d.records(task.workload_key)
        assert [r.schedule for r in stored] == [r.schedule for r in res.records]
        assert all(r.unmeasured for r in stored)
        assert d.best(task.workload_key) is None  # never the fastest: nothing was timed
    sched = best_schedule(task, db, target="pallas")
    assert sched == res.records[0].schedule
    assert best_schedule(task, db, target="cpu") is None  # records are kept per target
    kernel = build(task, sched, target="pallas")
    ins = task.random_inputs(11)
    out = kernel(*[ins[n] for n, _ in task.input_shapes])
    assert out.shape == task.output_shape and "pallas_call" in kernel.source
    np.testing.assert_allclose(out, task.reference(ins), rtol=1e-5, atol=1e-5)


def test_a_timed_record_wins_over_unmeasured_ones(tmp_path):
    """With a backend that times (a GPU; here interpret mode pretending to be one), records carry
    latencies and are ok; the fastest timed record is chosen over earlier unmeasured ones."""
    task = TASKS["softmax"]
    scheds = pallas_schedules(task, seed=5, per_sketch=1, n_mutants=0)[:2]
    untimed = PallasMeasurer(task, opts=MeasureOptions(repeats=2, min_time_s=0.0)).measure(scheds[:1])

    class Timed(PallasBackend):
        timed = True

    timed = PallasMeasurer(task, backend=Timed(interpret=True), opts=MeasureOptions(repeats=2, min_time_s=0.0))
    rec = timed.measure(scheds[1:2])[0]
    assert rec.ok and len(rec.latencies_s) >= 2 and rec.extra["measured"] is True
    assert chosen_record(untimed + [rec]) is rec
    assert chosen_record(untimed) is untimed[0] and untimed[0].unmeasured
    with TuningDB(str(tmp_path / "db.sqlite")) as d:
        for r in untimed + [rec]:
            d.add(TuningRecord(**{**r.__dict__, "target_key": PallasBackend().target_key()}))
        assert best_schedule(task, d, target="pallas") == scheds[1]


def test_wrong_kernels_are_error_records_not_unmeasured(monkeypatch):
    task = TASKS["layernorm"]
    m = PallasMeasurer(task)
    m.ref = m.ref + 1.0  # as if the kernel computed something else
    rec = m.measure(pallas_schedules(task, seed=2, per_sketch=1, n_mutants=0)[:1])[0]
    assert rec.error.startswith("wrong result") and not rec.unmeasured and not rec.ok


def test_timing_helper_repeats_and_waits():
    import jax.numpy as jnp
    lat = time_runs_s(lambda x: jnp.sin(x) * 2, [jnp.ones(64)], MeasureOptions(warmup=1, repeats=3, min_time_s=0.0))
    assert len(lat) >= 3 and all(t > 0 for t in lat)


@pytest.mark.parametrize("target", ["gpu", "triton", "CPU"])
def test_unknown_target_is_refused_with_the_choices(tmp_path, target):
    task = TASKS["matmul"]
    for call in (lambda: tune(task, target=target, db=str(tmp_path / "x.sqlite")),
                 lambda: build(task, [], target=target),
                 lambda: best_schedule(task, str(tmp_path / "x.sqlite"), target=target)):
        with pytest.raises(ValueError, match=r"target '.*' is not supported; use 'cpu' .* or 'pallas'"):
            call()


def test_features_carry_the_backend_and_models_keep_to_one():
    task = TASKS["matmul_relu"]
    rng = random.Random(0)
    pallas_feats = [kernel_features(pallas_program(task.dag, s)) for s in pallas_schedules(task, 1, 2, 0)]
    c_feats = [statement_features(lower(replay(task.dag, annotate(sk, task.dag, rng))))
               for sk in generate_sketches(task.dag)[:2]]
    assert all(f["backend"] == "pallas" and f["est_s"] > 0 for p in pallas_feats for f in p)
    assert all(f["backend"] == "c" for p in c_feats for f in p)
    assert program_vector(pallas_feats[0]).shape == (2 * len(PALLAS_FEATURES) + 1,)
    with pytest.raises(ValueError, match="one model per backend"):
        feature_matrix(pallas_feats + c_feats)
    model = XGBoostCostModel()
    model.update(c_feats, [1e-3, 2e-3], [task.workload_key] * 2)
    assert model.backend == "c"
    with pytest.raises(ValueError, match="trained on c programs"):
        model.update(pallas_feats, [1e-3] * len(pallas_feats), [task.workload_key] * len(pallas_feats))
    with pytest.raises(ValueError, match="trained on c programs"):
        model.predict(pallas_feats)


def test_gpu_prior_prefers_big_blocks_and_few_steps():
    """A 64^3 matmul as 4096 one-element programs, or with 64 reduction steps of one element,
    is estimated slower than as 16 programs of 16 x 16 blocks reducing in 16-element dots."""
    task = Task.matmul(64, 64, 64)

    def est(bi, bj, bk):
        return estimate_s(plan(replay(task.dag, [
            {"kind": "split", "stage": "C", "iter": "i", "factors": [bi]},
            {"kind": "split", "stage": "C", "iter": "j", "factors": [bj]},
            {"kind": "split", "stage": "C", "iter": "k", "factors": [bk]}])))

    good = est(16, 16, 16)
    assert est(1, 1, 16) > 2 * good and est(16, 16, 1) > 2 * good


def test_cli_tunes_pallas_in_interpret_mode(tmp_path, capsys):
    """`autopar tune --target pallas` without a GPU: the kernels are checked, not timed, and
    the records say so."""
    from autopar.cli import main

    db = str(tmp_path / "db.sqlite")
    assert main(["tune", "--task", "softmax", "--shape", "6,20", "--trials", "2", "--batch-size", "2",
                 "--policy", "random", "--target", "pallas", "--db", db]) == 0
    out = capsys.readouterr().out
    assert "interpret mode" in out and "not timed" in out
    with TuningDB(db) as database:
        recs = database.records(Task.softmax(6, 20).workload_key)
    assert len(recs) == 2 and all(r.unmeasured for r in recs)
    assert {r.target["kind"] for r in recs} == {"pallas"}
