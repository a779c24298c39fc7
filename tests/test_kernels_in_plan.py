"""Tuned C kernels inside a planned step (`parallelize(kernels="tuned"|"cached")`): the
plan's matmuls on each device's local shapes, called through `jax.ffi` as custom calls
`autopar_kernel`; the step equals `jax.jit` on 1 device and on 1x8 and 2x4 meshes, a kernel
slower than XLA's code or with a wrong result is not used, and without a compiler the step
runs on XLA's code and says so."""
import warnings

import jax
import numpy as np
import pytest

import autopar
import search.task_scheduler
from autopar import kernel_choice, kernel_in_step
from autopar.ffi_kernels import FfiShim
from autopar.kernel_sites import ConvSite, kernel_sites, matmul_sites
from models import make
from rockmate.graph import trace_graph


MESHES = [None, (1, 8), (2, 4)]
HEAD_TO_HEAD = kernel_choice.head_to_head
MEASURE_INTO = search.task_scheduler.measure_into


def _pstep(step, mesh, **kw):
    method = autopar.ShardParallel(mesh_shape=mesh) if mesh else "auto"
    devices = jax.devices()[:1] if mesh is None else jax.devices()
    return autopar.parallelize(step, devices=devices, method=method, **kw)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """(tuning DB path, {(model, mesh): plan}): the plans of the MLP and the GPT on each
    mesh (made once; the tests restore them), and a tuning DB with one schedule (the
    untransformed loop nest) for every local matmul of those plans, written as records so
    that these tests compile kernels but do not tune; `test_tuned_for_real` runs the search."""
    from search import TuningRecord
    from search.backend import CBackend

    path = str(tmp_path_factory.mktemp("kernels") / "tuning.db")
    backend = CBackend()
    tasks, plans = {}, {}
    for model in ("mlp", "gpt", "conv"):
        step, state, batch = make(model, "sgd")
        for mesh in MESHES:
            exe = _pstep(step, mesh)._executable((state, batch), {})
            plans[(model, mesh)] = exe.plan
            graph, sharding = exe.planned.graph, exe.planned.sharding
            for site in kernel_sites(graph, sharding.var_specs, sharding.mesh_shape):
                t = site.task()
                tasks[t.workload_key] = t
    with autopar.TuningDB(path) as database:
        database.add_many(TuningRecord(workload_key=k, task=t.to_dict(), target_key=backend.target_key(),
                                       target=backend.target(), schedule=[], latencies_s=(1.0,))
                          for k, t in tasks.items())
    return path, plans


def _leaves_close(got, want, rtol=1e-4):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * (np.abs(b).max() + 1e-12))


def _two_steps_equal_jit(pstep, step, state, batch):
    """Two steps of `pstep` equal two of jax.jit(step) (rtol 1e-4); returns jit's first."""
    s1, loss1 = pstep(state, batch)
    s2, loss2 = pstep(s1, batch)
    r1, rl1 = jax.jit(step)(state, batch)
    r2, rl2 = jax.jit(step)(r1, batch)
    np.testing.assert_allclose([float(loss1), float(loss2)], [float(rl1), float(rl2)], rtol=1e-4)
    _leaves_close(s2, r2)
    return r1, rl1


def _kernels_win(site, kernel, dims):
    """head_to_head with the real numerics check but the kernel reported faster."""
    t_k, t_x, err = HEAD_TO_HEAD(site, kernel, dims, rounds=1)
    return 0.0, 1.0, err


def _step_faster_with_more_kernels(build, args, kwargs, a, b, rounds=1):
    """kernel_in_step.step_times reporting the step with kernels `b` faster than with `a`."""
    return 1.0, 0.5


def _force_kernels(monkeypatch):
    """Kernels win head to head (their numerics still checked) and in the step."""
    monkeypatch.setattr(kernel_choice, "head_to_head", _kernels_win)
    monkeypatch.setattr(kernel_in_step, "step_times", _step_faster_with_more_kernels)


@pytest.mark.parametrize("model,mesh", [(m, mesh) for m in ("mlp", "gpt") for mesh in MESHES] + [("conv", None)])
def test_step_with_kernels_equals_jit(model, mesh, planned, monkeypatch, tmp_path):
    db, plans = planned
    _force_kernels(monkeypatch)
    local_db = tmp_path / "copy.db"      # the forced timings stay out of the shared DB
    local_db.write_bytes(open(db, "rb").read())
    step, state, batch = make(model, "sgd")
    pstep = _pstep(step, mesh, kernels="cached", tuning_db=str(local_db), plan=plans[(model, mesh)])
    _two_steps_equal_jit(pstep, step, state, batch)
    uses = pstep.plan.stages[0].kernels
    used = [k for k in uses if k.used]
    assert used, uses
    text = pstep.lower(state, batch).compile().as_text()
    assert text.count('custom_call_target="autopar_kernel"') >= len(used)
    # forward and backward matmuls are both served: ops after the loss are the gradient's
    graph = trace_graph(step, state, batch)
    assert {graph.ops[k.op].name for k in used} == ({"dot_general", "conv_general_dilated"} if model == "conv"
                                                    else {"dot_general"})
    assert len(used) >= 2
    if model == "gpt":       # attention's batched products, forward and backward, on kernels too
        assert sum(k.workload_key.startswith("batch_matmul") for k in used) >= 4


def test_slower_or_wrong_kernels_are_not_used(planned, monkeypatch, tmp_path):
    db = planned[0]
    step, state, batch = make("mlp", "sgd")
    local_db = tmp_path / "copy.db"
    local_db.write_bytes(open(db, "rb").read())
    monkeypatch.setattr(kernel_choice, "head_to_head", lambda site, kernel, dims: (2.0, 1.0, 0.0))
    pstep = autopar.parallelize(step, devices=jax.devices()[:1], kernels="cached", tuning_db=str(local_db))
    pstep(state, batch)
    uses = pstep.plan.stages[0].kernels
    assert uses and not any(k.used for k in uses)
    assert {k.reason for k in uses} <= {"slower than XLA", "no tuned schedule"}
    assert "autopar_kernel" not in pstep.lower(state, batch).compile().as_text()

    monkeypatch.setattr(kernel_choice, "head_to_head", lambda site, kernel, dims: (0.0, 1.0, 0.5))
    other_db = tmp_path / "other.db"
    other_db.write_bytes(open(db, "rb").read())
    with pytest.warns(UserWarning, match="does not match XLA's result"):
        pstep = autopar.parallelize(step, devices=jax.devices()[:1], kernels="cached", tuning_db=str(other_db))
        out = pstep(state, batch)
    assert not any(k.used for k in pstep.plan.stages[0].kernels)
    _leaves_close(out, jax.jit(step)(state, batch))


def test_tuned_for_real(tmp_path, monkeypatch):
    """The whole path: the search tunes every local matmul of the MLP's plan (2 trials
    each), each kernel is timed against XLA's code head to head, the faster one serves the
    op; the comparison is stored and `kernels="cached"` reuses it without measuring again."""
    step, state, batch = make("mlp", "sgd")
    path = str(tmp_path / "tuning.db")
    pstep = autopar.parallelize(step, devices=jax.devices()[:1], kernels="tuned", tuning_trials=2, tuning_db=path)
    out = pstep(state, batch)
    uses = pstep.plan.stages[0].kernels
    timed = [k for k in uses if k.tuned_s is not None]
    assert len(timed) == len(uses) > 0           # every task got a schedule
    assert all(k.used <= (k.tuned_s < k.xla_s) for k in timed)
    assert all(k.used or k.reason == ("slower in the step" if k.tuned_s < k.xla_s else "slower than XLA")
               for k in timed)
    _leaves_close(out, jax.jit(step)(state, batch))
    with autopar.TuningDB(path) as database:
        assert len(database.profiles(kernel_choice.PROFILE_KIND)) >= len({k.workload_key for k in uses})

    def no_measuring(*args):
        raise AssertionError("kernels='cached' measured again")

    monkeypatch.setattr(kernel_choice, "head_to_head", no_measuring)
    monkeypatch.setattr(kernel_in_step, "step_times", no_measuring)
    again = autopar.parallelize(step, devices=jax.devices()[:1], kernels="cached", tuning_db=path)
    again(state, batch)
    assert again.plan.stages[0].kernels == uses
    summary = again.plan.summary()          # what `autopar inspect` prints
    assert f"{sum(k.used for k in uses)} of {len(uses)} ops on tuned kernels" in summary
    assert uses[0].workload_key in summary
    assert autopar.Plan.from_json(again.plan.to_json()).stages[0].kernels == uses


def test_sites_are_local_matmuls_under_the_plan():
    step, state, batch = make("mlp", "sgd")
    graph = trace_graph(step, state, batch)
    sites = matmul_sites(graph, {}, (1, 1))
    x = graph.ops[sites[0].op]
    assert all(graph.ops[s.op].name == "dot_general" for s in sites)
    # the first dense layer, batch 16 x 32 features -> 64: forward (M, N, K) = (16, 64, 32) and
    # its weight gradient dY^T . X (64, 32, 16); the second's input gradient dY . W^T (16, 64, 64)
    shapes = {(s.M, s.N, s.K) for s in sites}
    assert {(16, 64, 32), (64, 32, 16), (16, 64, 64)} <= shapes and x.name == "dot_general"
    # split the batch 8 ways: the forward's local M shrinks; a split contraction is left to XLA
    specs = {v: ((0,),) + ((),) * (len(graph.vars[v].shape) - 1) for v in graph.vars
             if graph.vars[v].shape and graph.vars[v].shape[0] == 16}
    local = matmul_sites(graph, specs, (8, 1))
    assert (2, 64, 32) in {(s.M, s.N, s.K) for s in local}
    assert all(not any(s.lhs_spec[d] for d in range(len(s.lhs_spec)) if d in
                       graph.ops[s.op].params["dimension_numbers"][0][0]) for s in local)


def test_attention_products_are_batched_matmul_sites():
    """The GPT's attention scores `bqhd,bkhd->bhqk` (batch dims b, h) are a batch_matmul of
    B = batch x heads; with the batch split 2 ways the local B halves."""
    step, state, batch = make("gpt", "sgd")
    graph = trace_graph(step, state, batch)
    bm = [s for s in matmul_sites(graph, {}, (1, 1)) if s.B is not None]
    assert bm and all(s.task().op == "batch_matmul" for s in bm)
    tokens = batch[0].shape
    heads = 2                                  # tests/models.py's GPT
    assert {s.B for s in bm} == {tokens[0] * heads}
    split = {v: ((0,),) + ((),) * (len(graph.vars[v].shape) - 1) for v in graph.vars
             if len(graph.vars[v].shape) == 4 and graph.vars[v].shape[0] == tokens[0]}
    local = [s for s in matmul_sites(graph, split, (2, 1)) if s.B is not None]
    assert {s.B for s in local} == {tokens[0] * heads // 2}
    # an operand whose batch dim is split while the other's is whole is left to XLA
    one_side = {v: spec for v, spec in split.items() if v == graph.ops[bm[0].op].inputs[0]}
    assert bm[0].op not in {s.op for s in matmul_sites(graph, one_side, (2, 1))}


def test_convolutions_are_conv2d_sites_in_any_layout():
    """The conv net's stride-1 SAME conv (NHWC x HWIO) and its weight gradient (the same
    conv with batch and channels swapped: out HWIO) are conv2d sites; the stride-2 conv
    (asymmetric padding) and the input gradients (dilations) are left to XLA. Each site's
    local call equals the op on random operands, and a split batch halves the local N."""
    step, state, batch = make("conv", "sgd")
    graph = trace_graph(step, state, batch)
    convs = [op for op in graph.ops if op.name == "conv_general_dilated"]
    sites = conv_sites_of(graph, {}, (1, 1))
    assert len(sites) == 2 and len(convs) == 5
    fwd, wgrad = sites
    assert (fwd.N, fwd.H, fwd.W, fwd.CI, fwd.CO, fwd.KH, fwd.KW, fwd.stride, fwd.pad) == (8, 8, 8, 4, 8, 3, 3, 1, 1)
    assert (wgrad.KH, wgrad.KW, wgrad.out_local) == (8, 8, (3, 3, 4, 8))
    rng = np.random.default_rng(0)
    for site in sites:            # the task's numpy reference on the transposed operands = the op

        op = graph.ops[site.op]
        lhs = rng.standard_normal(site.lhs_local).astype(np.float32)
        rhs = rng.standard_normal(site.rhs_local).astype(np.float32)
        task = site.task()
        a, b = lhs.transpose(site.lhs_perm), rhs.transpose(site.rhs_perm)
        got = task.reference(dict(zip([n for n, _ in task.input_shapes], (a, b)))).transpose(site.out_perm)
        want = np.asarray(kernel_choice._xla_op(op)(lhs, rhs))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    split = {v: ((0,),) + ((),) * 3 for v in graph.vars if graph.vars[v].shape[:1] == (8,)
             and len(graph.vars[v].shape) == 4 and graph.vars[v].dtype == "float32"}
    local = conv_sites_of(graph, split, (2, 1))
    assert [s.N for s in local] == [4]              # the weight gradient's contraction is split: XLA's


def conv_sites_of(graph, specs, mesh_shape):
    return [s for s in kernel_sites(graph, specs, mesh_shape) if isinstance(s, ConvSite)]


def test_kernels_that_slow_the_step_are_not_kept(planned, monkeypatch, tmp_path):
    """Kernels that beat XLA head to head but make the whole step slower are dropped task
    by task ("slower in the step"); a task that speeds the step up is kept; the decision is
    stored and `kernels="cached"` reuses it without timing the step again."""
    db = planned[0]
    step, state, batch = make("mlp", "sgd")
    local_db = tmp_path / "copy.db"
    local_db.write_bytes(open(db, "rb").read())
    monkeypatch.setattr(kernel_choice, "head_to_head", _kernels_win)
    calls = []

    def only_one_task_helps(build, args, kwargs, a, b, rounds=1):
        calls.append((a, b))
        keys = lambda c: set() if c is None else {s.task().workload_key for s in c.sites.values()}
        helps = sorted(keys(b))[0] if keys(b) else None
        # the step gets faster only with `helps` (the first task in sorted order), slower with any other
        cost = lambda c: 1.0 + 0.1 * len(keys(c) - {helps}) - (0.1 if helps in keys(c) else 0.0)
        return cost(a), cost(b)

    monkeypatch.setattr(kernel_in_step, "step_times", only_one_task_helps)
    pstep = autopar.parallelize(step, devices=jax.devices()[:1], kernels="cached", tuning_db=str(local_db))
    out = pstep(state, batch)
    uses = pstep.plan.stages[0].kernels
    kept = {k.workload_key for k in uses if k.used}
    dropped = {k.workload_key for k in uses if k.reason == "slower in the step"}
    assert len(kept) == 1 and dropped and not kept & dropped
    assert calls
    text = pstep.lower(state, batch).compile().as_text()
    assert text.count('custom_call_target="autopar_kernel"') == sum(k.used for k in uses)
    _leaves_close(out, jax.jit(step)(state, batch))

    def no_timing(*args, **kw):
        raise AssertionError("kernels='cached' timed the step again")

    monkeypatch.setattr(kernel_in_step, "step_times", no_timing)
    again = autopar.parallelize(step, devices=jax.devices()[:1], kernels="cached", tuning_db=str(local_db))
    again(state, batch)
    assert again.plan.stages[0].kernels == uses


def test_no_compiler_runs_on_xla_and_says_so_once(monkeypatch, tmp_path):
    monkeypatch.setattr(FfiShim, "_instance", None)
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    step, state, batch = make("mlp", "sgd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pstep = autopar.parallelize(step, devices=jax.devices()[:1], kernels="cached", tuning_db=str(tmp_path / "d.db"))
        out = pstep(state, batch)
    said = [w for w in caught if "FFI shim is unavailable" in str(w.message)]
    assert len(said) == 1 and "no C++ compiler" in str(said[0].message)
    assert not any(k.used for k in pstep.plan.stages[0].kernels)
    _leaves_close(out, jax.jit(step)(state, batch))


def test_bad_options():
    step = make("mlp", "sgd")[0]
    with pytest.raises(ValueError, match="kernels='fast'"):
        autopar.parallelize(step, kernels="fast")
    with pytest.raises(ValueError, match="tuning_trials"):
        autopar.parallelize(step, kernels="tuned", tuning_trials=0)


def _cli(*argv: str) -> int:
    from autopar.cli import main

    return main(list(argv))


def test_plan_lists_kernel_tasks_and_tune_plan_fills_the_db(tmp_path, capsys, monkeypatch):
    """Every single-stage plan lists its local ops as kernel tasks (with kernels="xla" too);
    `autopar tune --plan` tunes exactly those into the DB, after which kernels="cached"
    with that plan finds a schedule for every op, and `autopar db list` shows each
    workload's time against XLA's."""
    step, state, batch = make("mlp", "sgd")
    pstep = autopar.parallelize(step, devices=jax.devices()[:1])
    pstep(state, batch)
    plan = pstep.plan
    sites = matmul_sites(pstep._executable((state, batch), {}).planned.graph, {}, (1, 1))
    tasks = plan.stages[0].kernel_tasks
    assert sum(kt.ops for kt in tasks) == len(sites)
    assert {kt.workload_key for kt in tasks} == {s.task().workload_key for s in sites}
    assert "autopar tune --plan" in plan.summary()
    plan_file, db = tmp_path / "plan.json", str(tmp_path / "tuning.db")
    plan.save(plan_file)
    assert autopar.Plan.load(plan_file).stages[0].kernel_tasks == tasks

    assert _cli("tune", "--plan", str(plan_file), "--trials", "2", "--db", db) == 0
    table = capsys.readouterr().out
    assert all(kt.workload_key in table for kt in tasks), table
    with autopar.TuningDB(db) as database:
        assert {kt.workload_key for kt in tasks} <= {k for k, _, _ in database.workloads()}
    cached = autopar.parallelize(step, devices=jax.devices()[:1], kernels="cached", tuning_db=db, plan=plan)
    _leaves_close(cached(state, batch), jax.jit(step)(state, batch))
    uses = cached.plan.stages[0].kernels
    assert len(uses) == len(sites) and all(k.tuned_s is not None for k in uses)
    capsys.readouterr()
    assert _cli("db", "list", "--db", db) == 0
    listing = capsys.readouterr().out
    assert "tuned vs XLA" in listing
    for kt in tasks:
        row = next(line for line in listing.splitlines() if kt.workload_key[:30] in line)
        assert row.rstrip(" │").endswith("x"), row      # a speedup for every tuned workload

    assert _cli("tune", "--plan", str(tmp_path / "missing.json"), "--db", db) == 2
    assert "cannot read plan file" in capsys.readouterr().err
    assert _cli("tune", "--plan", str(plan_file), "--task", "matmul", "--db", db) == 2
    assert "leave out --task" in capsys.readouterr().err


def _interrupt_after_first_round(monkeypatch):
    """Make the task scheduler's second measuring round raise KeyboardInterrupt (Ctrl-C)."""
    import search.task_scheduler as scheduler

    real, calls = MEASURE_INTO, []

    def measure_then_stop(*args, **kw):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(scheduler, "measure_into", measure_then_stop)


def test_interrupted_tuning_keeps_records_and_the_step_runs(tmp_path, monkeypatch, capsys):
    """Ctrl-C during tuning: `autopar tune --plan` exits 130 with the first round's
    records kept; `kernels="tuned"` says so once, serves the ops it has kernels for from
    that round, leaves the rest to XLA, and the step equals jax.jit."""
    step, state, batch = make("mlp", "sgd")
    pstep = autopar.parallelize(step, devices=jax.devices()[:1])
    pstep(state, batch)
    plan_file, db = tmp_path / "plan.json", str(tmp_path / "tuning.db")
    pstep.plan.save(plan_file)
    _interrupt_after_first_round(monkeypatch)
    assert _cli("tune", "--plan", str(plan_file), "--trials", "2", "--db", db) == 130
    assert "interrupted" in capsys.readouterr().err
    with autopar.TuningDB(db) as database:
        assert len(database.workloads()) == 1           # one task's round, kept

    _force_kernels(monkeypatch)
    _interrupt_after_first_round(monkeypatch)
    fresh = str(tmp_path / "fresh.db")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tuned = autopar.parallelize(step, devices=jax.devices()[:1], kernels="tuned", tuning_trials=2,
                                    tuning_db=fresh)
        out = tuned(state, batch)
    said = [w for w in caught if "interrupted" in str(w.message)]
    assert len(said) == 1 and "XLA's code" in str(said[0].message)
    uses = tuned.plan.stages[0].kernels
    assert any(k.used for k in uses) and any(k.reason == "no tuned schedule" for k in uses)
    _leaves_close(out, jax.jit(step)(state, batch))


@pytest.mark.parametrize("compiler", ["missing", "broken"])
def test_no_or_broken_c_compiler_runs_on_xla_and_says_so_once(compiler, tmp_path, monkeypatch):
    """kernels="tuned" when the C compiler that builds candidate kernels is missing, or
    exists but fails every build: one warning naming the problem, every op on XLA's code,
    the step equals jax.jit."""
    cc = tmp_path / "no-such-cc" if compiler == "missing" else "false"
    monkeypatch.setenv("CC", str(cc))
    step, state, batch = make("mlp", "sgd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pstep = autopar.parallelize(step, devices=jax.devices()[:1], kernels="tuned", tuning_trials=2,
                                    tuning_db=str(tmp_path / "d.db"))
        out = pstep(state, batch)
    said = [str(w.message) for w in caught if "autopar kernels" in str(w.message)]
    assert len(said) == 1, said
    assert ("no C compiler" in said[0]) if compiler == "missing" else ("no valid kernel" in said[0])
    assert pstep.plan.stages[0].kernels and not any(k.used for k in pstep.plan.stages[0].kernels)
    _leaves_close(out, jax.jit(step)(state, batch))


def test_pipeline_stages_run_kernels_and_equal_jit(tmp_path, monkeypatch):
    """A 2-stage pipeline (per-stage runtime, ILP-sharded stages) with kernels from the DB:
    each stage's layer graphs call the kernels for their local matmuls, forward and
    backward; two steps equal jax.jit; the plan lists the kernels per stage and layer, and
    a saved plan reuses them."""
    import optax
    from pipeline_gpt import init_state, make_batch, make_step
    from search import TuningRecord
    from search.backend import CBackend

    opt = optax.sgd(0.1, momentum=0.9)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(1), 8)
    step = make_step(opt, markers=True)
    method = dict(num_micro_batches=2, num_stages=2, lowering="per-stage")
    xla = autopar.parallelize(step, method=autopar.PipeshardParallel(**method))
    xla(state, batch)
    tasks = {kt.workload_key: kt for s in xla.plan.stages for kt in s.kernel_tasks}
    assert all(s.kernel_tasks for s in xla.plan.stages) and not any(s.kernels for s in xla.plan.stages)
    db, backend = str(tmp_path / "tuning.db"), CBackend()
    from autopar.kernel_sites import search_task

    with autopar.TuningDB(db) as database:
        database.add_many(TuningRecord(workload_key=k, task=search_task(kt).to_dict(),
                                       target_key=backend.target_key(), target=backend.target(), schedule=[],
                                       latencies_s=(1.0,)) for k, kt in tasks.items())
    monkeypatch.setattr(kernel_choice, "head_to_head", _kernels_win)
    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(**method), kernels="cached", tuning_db=db)
    r1, rl1 = _two_steps_equal_jit(pstep, step, state, batch)
    for stage, programs in zip(pstep.plan.stages, pstep._executable((state, batch), {}).programs):
        used = [k for k in stage.kernels if k.used]
        assert used and all(k.layer is not None for k in used)
        text = programs.forward_compiled.as_text() + programs.backward_compiled.as_text()
        assert text.count('custom_call_target="autopar_kernel"') >= len(used)
    assert "tuned kernels" in pstep.plan.summary()
    again = autopar.parallelize(step, method=autopar.PipeshardParallel(**method), kernels="cached", tuning_db=db,
                                plan=autopar.Plan.from_json(pstep.plan.to_json()))
    _leaves_close(again(state, batch), (r1, rl1))
    assert [s.kernels for s in again.plan.stages] == [s.kernels for s in pstep.plan.stages]

    with pytest.raises(ValueError, match="token slicing runs XLA's code"):
        autopar.parallelize(step, method=autopar.PipeshardParallel(token_slices=2, **method),
                            kernels="cached")(state, batch)
