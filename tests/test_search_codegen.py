"""Property test: every schedule the sketch rules, annotation, mutations and crossover produce
compiles to C and computes what numpy computes (checked by the runner against a float64 numpy
reference of the operator; a wrong kernel is an error record)."""
import random

import numpy as np
import pytest

from search import Task, build
from search.measure import MeasureOptions, ProgramMeasurer
from search.mutation import MUTATIONS, crossover, mutate
from search.sketch import annotate, generate_sketches

TASKS = {
    "matmul_relu": Task.matmul(16, 24, 8, epilogue="relu"),
    "dense_gelu": Task.dense(8, 32, 12, "gelu"),
    "batch_matmul": Task.batch_matmul(3, 8, 16, 4),
    "softmax": Task.softmax(6, 32),
    "layernorm": Task.layernorm(8, 24),
    "conv2d_pad": Task.conv2d(1, 6, 6, 4, 8, 3, 3, 1, 1),
    "conv2d_stride": Task.conv2d(2, 7, 7, 3, 4, 3, 3, 2, 0),
}
FAST = MeasureOptions(repeats=1, min_time_s=0.0, rtol=1e-4)


def random_schedules(task, seed, per_sketch=1, n_mutants=3, n_children=2):
    rng = random.Random(seed)
    dag = task.dag
    base = []
    for sk in generate_sketches(dag):
        for _ in range(per_sketch):
            s = annotate(sk, dag, rng)
            assert s is not None, f"sketch {sk.name} of {task} has no valid annotation"
            base.append(s)
    mutants = [m for m in (mutate(dag, rng.choice(base), rng) for _ in range(n_mutants)) if m is not None]
    children = []
    for _ in range(20):
        if len(children) >= n_children:
            break
        c = crossover(dag, rng.choice(base + mutants), rng.choice(base + mutants), rng)
        if c is not None:
            children.append(c)
    return base, mutants, children


@pytest.mark.parametrize("name", sorted(TASKS))
def test_random_schedules_compile_and_match_numpy(name):
    task = TASKS[name]
    base, mutants, children = random_schedules(task, seed=hash(name) % 1000)
    assert mutants, "mutations produced nothing"
    m = ProgramMeasurer(task, opts=FAST)
    try:
        recs = m.measure(base + mutants + children)
    finally:
        m.close()
    bad = [(r.error, r.schedule) for r in recs if not r.ok]
    assert not bad, bad[0]


def test_every_mutation_kind_yields_valid_schedules():
    """Each mutation kind changes some annotated softmax schedule (some schedules leave a
    kind nothing to change, e.g. a single parallel loop), and what it returns is valid."""
    task = TASKS["softmax"]
    rng = random.Random(3)
    sketches = generate_sketches(task.dag)
    bases = [annotate(sketches[k % len(sketches)], task.dag, rng) for k in range(8)]
    for op in sorted(set(MUTATIONS), key=lambda f: f.__name__):
        got = [(s, op(task.dag, s, rng)) for s in bases for _ in range(5)]
        assert any(g is not None and g != s for s, g in got), op.__name__


def test_built_kernel_matches_numpy_directly():
    task = TASKS["dense_gelu"]
    rng = random.Random(0)
    sched = annotate(generate_sketches(task.dag)[1], task.dag, rng)
    k = build(task, sched)
    r = np.random.default_rng(5)
    a, b, bias = (r.standard_normal(s).astype(np.float32) for _, s in task.input_shapes)
    x = a.astype(np.float64) @ b + bias
    ref = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(k(a, b, bias), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="shape"):
        k(a.T, b, bias)
