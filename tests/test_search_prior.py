"""The analytic prior (search.prior): closed-form costs of small loop nests, the effects it must
see (vectorisation, parallel speed-up, fork-join, recomputation), its ranking of measured
schedules, and its use as the cost model's base margin and the first batch's ranking."""
import json
import random

import numpy as np
import pytest

from cost_model import XGBoostCostModel, pairwise_accuracy
from search import Task
from search.evolution import EvolutionarySearch
from search.features import statement_features
from search.backend import CBackend
from search.lower import lower
from search.measure import MeasureOptions, ProgramMeasurer
from search.prior import CpuModel, estimate_s, statement_estimates
from search.schedule import replay
from search.sketch import generate_sketches, sample_schedules

from measured import measured_schedules

ONE_CORE = CpuModel(cores=1)


def est(task: Task, steps: list, m: CpuModel = ONE_CORE) -> float:
    return estimate_s(lower(replay(task.dag, steps)), m)


def test_naive_matmul_closed_form():
    """i, j, k order, 16^3. The zero-init nest writes C's 1 KiB once: memory-bound at 4.5 bytes
    per cycle. The update walks B with stride N along k, so nothing vectorises, and its one
    scalar accumulator adds once per 4-cycle latency: 4 cycles per multiply-add (more than
    the 2 operations on 2 ports, the 2 loads on 2 ports, or the 3 KiB of A, B and C)."""
    M = N = K = 16
    got = statement_estimates(lower(replay(Task.matmul(M, N, K).dag, [])), ONE_CORE)
    assert got == pytest.approx([M * N * 4 / 4.5 / ONE_CORE.hz, 4 * M * N * K / ONE_CORE.hz])


def test_unit_stride_innermost_loop_vectorises():
    """i, k, j with j vectorised: 16 lanes, and C's row stays in registers across k.
    (Unannotated, the 64-wide j is a register tile the printer unrolls, left scalar.)"""
    task = Task.matmul(64, 64, 64)
    ikj = [{"kind": "reorder", "stage": "C", "order": ["i", "k", "j"]},
           {"kind": "annotate", "stage": "C", "iter": "j", "ann": "vectorize"}]
    assert est(task, []) / est(task, ikj) > 8


def test_parallel_speedup_is_extent_over_the_busiest_core():
    task = Task.matmul(48, 64, 64)
    two = CpuModel(cores=2, fork_join_s=0.0)
    base = est(task, [], two)
    par = est(task, [{"kind": "annotate", "stage": "C", "iter": "i", "ann": "parallel"}], two)
    assert base / par == pytest.approx(2.0, rel=1e-3)
    # 3 iterations on 2 cores: the busier core runs 2 of 3
    split3 = [{"kind": "split", "stage": "C", "iter": "i", "factors": [16]},
              {"kind": "annotate", "stage": "C", "iter": "i.0", "ann": "parallel"}]
    assert est(task, [{"kind": "split", "stage": "C", "iter": "i", "factors": [16]}], two) / est(task, split3, two) \
        == pytest.approx(1.5, rel=1e-3)


def test_each_parallel_region_pays_fork_join_once():
    """The difference a fork-join cost makes is that cost times the number of parallel
    regions in the generated C."""
    task = Task.matmul(8, 64, 4)
    m0, m1 = CpuModel(cores=2, fork_join_s=0.0), CpuModel(cores=2, fork_join_s=1e-6)
    steps = [{"kind": "annotate", "stage": "C", "iter": "i", "ann": "parallel"}]
    regions = CBackend().source(replay(task.dag, steps)).count("#pragma omp parallel")
    assert regions >= 1
    assert est(task, steps, m1) - est(task, steps, m0) == pytest.approx(regions * 1e-6)
    assert est(task, [], m1) == est(task, [], m0)


def _layernorm_at(where: str) -> list:
    """The fused layernorm of benchmark W5 with both reductions computed at out's loop `where`."""
    return [{"kind": "split", "stage": "out", "iter": "j", "factors": [16]},
            {"kind": "annotate", "stage": "out", "iter": "i", "ann": "parallel"},
            {"kind": "annotate", "stage": "out", "iter": "j.1", "ann": "vectorize"},
            {"kind": "compute_at", "stage": "T_var", "target": "out", "iter": where},
            {"kind": "compute_at", "stage": "T_mean", "target": "out", "iter": where}]


def test_recomputing_row_statistics_per_tile_is_estimated_far_slower():
    """Computed at out.j.0, mean and variance of a row are recomputed for each of its 64 tiles;
    at out.i once per row. Measured on W5 in benchmark run 8: 33 ms (per 8-column tile) against
    0.66 ms. The estimate sees the 64x work; the data stays in L1, so it is not 64x slower."""
    task = Task.layernorm(256, 1024)
    once, per_tile = est(task, _layernorm_at("i")), est(task, _layernorm_at("j.0"))
    assert per_tile / once > 5


def test_prior_ranks_measured_schedules_better_than_chance():
    """Single-threaded measurements of 80 random 64^3 matmul schedules (the cost-model test's
    set). Measured: 0.84 here (0.59-0.60 before the register-tile model; chance 0.5),
    0.68-0.85 on the benchmark's workloads."""
    task = Task.matmul(64, 64, 64)
    scheds, lat = measured_schedules(task, 80, 11)
    scores = [-est(task, s) for s in scheds]
    acc = pairwise_accuracy(scores, lat)
    print(f"prior pairwise accuracy on {len(lat)} measured matmul schedules: {acc:.3f}")
    assert acc > 0.7


def _progs(task: Task, n: int, seed: int) -> list:
    scheds = sample_schedules(generate_sketches(task.dag), task.dag, n, random.Random(seed))
    return [statement_features(lower(replay(task.dag, s))) for s in scheds]


def test_untrained_model_scores_by_the_prior_and_without_one_scores_nothing():
    progs = _progs(Task.matmul(32, 32, 32), 12, 0)
    want = [-np.log2(sum(s["est_s"] for s in p)) for p in progs]
    model = XGBoostCostModel()
    assert model.informed
    np.testing.assert_allclose(model.predict(progs), want, rtol=1e-5)
    plain = XGBoostCostModel(prior_weight=0.0)
    assert not plain.informed and not plain.predict(progs).any()


def test_measurements_override_the_prior_where_they_disagree():
    """Latencies that reverse the prior's order: after training, the model ranks the training
    programs by the measurements (the trees learn the prior's error)."""
    progs = _progs(Task.matmul(32, 32, 32), 40, 1)
    prior = XGBoostCostModel().predict(progs)
    lat = list(np.exp(prior - prior.max()))  # the prior's favourite is measured slowest
    assert pairwise_accuracy(prior, lat) < 0.05
    model = XGBoostCostModel()
    model.update(progs, lat, ["t"] * len(progs))
    assert pairwise_accuracy(model.predict(progs), lat) > 0.9


def test_save_load_keeps_the_prior_and_reads_files_saved_before_it(tmp_path):
    progs = _progs(Task.matmul(32, 32, 32), 20, 2)
    lat = [1.0 + i % 7 for i in range(20)]
    m = XGBoostCostModel(n_rounds=10, prior_weight=0.5)
    m.update(progs, lat, ["t"] * 20)
    path = tmp_path / "m.json"
    m.save(str(path))
    m2 = XGBoostCostModel.load(str(path))
    assert m2.prior_weight == 0.5
    np.testing.assert_allclose(m.predict(progs), m2.predict(progs), rtol=1e-5)
    old = json.loads(path.read_text())
    del old["prior_weight"], old["margins"]
    path.write_text(json.dumps(old))
    m3 = XGBoostCostModel.load(str(path))  # its trees were fitted without a margin
    assert m3.prior_weight == 0.0 and m3._margin == [0.0] * 20


def test_first_batch_of_a_new_task_is_ranked_by_the_prior():
    """No measurements and no other tasks' records: the batch (but its random tenth) is picked
    by the prior from the evolved population, so it is estimated faster than random draws."""
    task = Task.matmul(128, 128, 128)
    pol = EvolutionarySearch(task, seed=0)
    batch = pol.next_batch(16)
    n_random = round(16 * pol.eps_greedy)
    picked = sorted(estimate_s(lower(replay(task.dag, s))) for s in batch)[:16 - n_random]
    drawn = [estimate_s(lower(replay(task.dag, s)))
             for s in sample_schedules(pol.sketches, task.dag, 256, random.Random(5))]
    assert np.median(picked) < np.percentile(drawn, 10)
    cold = EvolutionarySearch(task, seed=0, cost_model=XGBoostCostModel(prior_weight=0.0)).next_batch(16)
    cold_est = [estimate_s(lower(replay(task.dag, s))) for s in cold]
    assert np.median(cold_est) > np.percentile(drawn, 10)


def _tiled(R: int, V: int, K: int) -> list:
    """An R x (16 V) register tile of C (R V accumulator vectors) updated over a K-long
    reduction tile: loops i.0, j.0, k.0, k.1, i.1, j.1 (vectorised)."""
    return [{"kind": "split", "stage": "C", "iter": "i", "factors": [R]},
            {"kind": "split", "stage": "C", "iter": "j", "factors": [16 * V]},
            {"kind": "split", "stage": "C", "iter": "k", "factors": [K]},
            {"kind": "reorder", "stage": "C", "order": ["i.0", "j.0", "k.0", "k.1", "i.1", "j.1"]},
            {"kind": "annotate", "stage": "C", "iter": "j.1", "ann": "vectorize"}]


def test_register_tiles_are_ordered_like_their_measurements():
    """Register tiles of a 256^3 matmul, timed on one core. Few accumulators are bound by the
    add latency (1 x 1 vector: 4 cycles per update; measured 1.24-1.34 ms against 0.23-0.30
    for 16 accumulators), a tile of 4 x 4 vectors is not held back by its 16 KiB B block no
    longer fitting L1 across the whole i loop (its rows are reused by the next k step). Every
    pair whose measured latencies differ by 2x or more must be estimated in that order."""
    task = Task.matmul(256, 256, 256)
    shapes = [(1, 1, 256), (2, 1, 256), (4, 1, 256), (2, 2, 256), (8, 2, 256), (4, 4, 256),
              (8, 2, 16), (16, 1, 256), (8, 4, 64)]
    scheds = [_tiled(*s) for s in shapes]
    m = ProgramMeasurer(task, opts=MeasureOptions(repeats=3, min_time_s=0.002, num_threads=1))
    try:      # two rounds, the faster of each: a test beside it on the other core can stall one
        rounds = [m.measure(scheds) for _ in range(2)]
    finally:
        m.close()
    assert all(r.ok for recs in rounds for r in recs)
    lat = [min(r.latency_s for r in pair) for pair in zip(*rounds)]
    e = [est(task, s) for s in scheds]
    wrong = [(shapes[a], shapes[b]) for a in range(len(shapes)) for b in range(len(shapes))
             if lat[a] > 2 * lat[b] and e[a] <= e[b]]
    print("measured ms", [round(x * 1e3, 3) for x in lat], "estimated ms", [round(x * 1e3, 3) for x in e])
    assert not wrong, f"estimated in the wrong order: {wrong}"


def test_a_short_reduction_tile_pays_for_copying_its_registers_in_and_out():
    """8 x 2 vectors of C reloaded from L2 and written back every 16 steps of k instead of
    every 256: measured 1.2-1.6x slower (1.37 against 0.86 ms on W1's 512^3, both cores)."""
    task = Task.matmul(256, 256, 256)
    assert est(task, _tiled(8, 2, 16)) > 1.2 * est(task, _tiled(8, 2, 256))


def test_traffic_counts_lines_shared_by_consecutive_iterations_once():
    """Naive i, j, k matmul, 256^3: the k loop walks a column of B (256 lines, 16 KiB) that
    fits L1, the j loop's 256 KiB of B does not. Consecutive j share B's lines (16 floats to a
    line), so each i moves B once (256 KiB) plus a row of A and of C (1 KiB each), not 256
    columns of 16 KiB."""
    from search.lower import For, Store
    from search.prior import _access, _traffic
    from search.expr import loads
    prog = lower(replay(Task.matmul(256, 256, 256).dag, []))
    nest = prog.body[-1]
    loops = []
    while isinstance(nest, For):
        loops.append(nest)
        nest = nest.body[-1]  # the zero-init store comes first
    assert isinstance(nest, Store) and nest.reduce_op and len(loops) == 3
    accs = [_access(nest.index, True)] + [_access(ld.index[0], False) for ld in loads(nest.value)]
    assert _traffic(accs, loops, ONE_CORE.l1_bytes) == 256 * (256 * 1024 + 1024 + 1024)


def test_a_register_tile_without_a_vectorised_loop_is_scalar():
    """The C printer fully unrolls a register tile's loops but the vectorised one; with none
    vectorised, gcc leaves the unrolled tile scalar. 8 x 32 on a 128^3 matmul, one core:
    measured and estimated over 4x slower than with the `j.1` loop vectorised (W1, 2 cores:
    41 ms against 0.88)."""
    task = Task.matmul(128, 128, 128)
    vec = _tiled(8, 2, 128)
    scalar = [s for s in vec if s.get("ann") != "vectorize"]
    m = ProgramMeasurer(task, opts=MeasureOptions(repeats=3, min_time_s=0.002, num_threads=1))
    try:
        fast, slow = (r.latency_s for r in m.measure([vec, scalar]))
    finally:
        m.close()
    print(f"measured {fast * 1e3:.3f} / {slow * 1e3:.3f} ms, estimated {est(task, vec) * 1e3:.3f} / "
          f"{est(task, scalar) * 1e3:.3f} ms")
    assert slow > 4 * fast
    assert est(task, scalar) > 4 * est(task, vec)
