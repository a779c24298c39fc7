"""Property test: every schedule the sketch rules, annotation, mutations and crossover produce
compiles to C and computes what numpy computes (checked by the runner against a float64 numpy
reference of the operator; a wrong kernel is an error record)."""
import os
import random
import time

import numpy as np
import pytest

from search import Task, build
from search.backend import CBackend
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


def _matmul_tile_schedule(i, j, k):
    """cache_write matmul: an (i3 x j3) accumulator tile under the innermost reduction loop k.1."""
    return [{"kind": "cache_write", "stage": "C"},
            {"kind": "split", "stage": "C.local", "iter": "i", "factors": i},
            {"kind": "split", "stage": "C.local", "iter": "j", "factors": j},
            {"kind": "split", "stage": "C.local", "iter": "k", "factors": k},
            {"kind": "reorder", "stage": "C.local",
             "order": ["i.0", "j.0", "i.1", "j.1", "k.0", "i.2", "j.2", "k.1", "i.3", "j.3"]},
            {"kind": "follow_split", "stage": "C", "iter": "i", "n": 1, "src": ["C.local", "i"]},
            {"kind": "follow_split", "stage": "C", "iter": "j", "n": 1, "src": ["C.local", "j"]},
            {"kind": "reorder", "stage": "C", "order": ["i.0", "j.0", "i.1", "j.1"]},
            {"kind": "annotate", "stage": "C", "iter": "i.0", "ann": "parallel"},
            {"kind": "annotate", "stage": "C.local", "iter": "j.3", "ann": "vectorize"},
            {"kind": "compute_at", "stage": "C.local", "target": "C", "iter": "j.0"}]


def test_register_tile_wraps_the_innermost_reduction_loop():
    """The i3 x j3 accumulator is copied into a local array around k.1 (and only there), and the
    kernel still computes A @ B; a tile larger than the register file is left in memory."""
    task = Task.matmul(32, 64, 48)
    a, b = (np.random.default_rng(1).standard_normal(s).astype(np.float32) for _, s in task.input_shapes)
    k = build(task, _matmul_tile_schedule([1, 2, 4], [1, 1, 16], [12]))
    assert k.source.count("C_local_reg[64]") == 1
    lines = k.source.splitlines()
    reg_at = next(n for n, ln in enumerate(lines) if "C_local_reg[64]" in ln)
    assert "for (int v0_k_1 = 0; v0_k_1 < 12;" in "\n".join(lines[reg_at:])
    np.testing.assert_allclose(k(a, b), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    big = build(task, _matmul_tile_schedule([1, 1, 32], [1, 1, 32], [12]))  # 1024 > 512 elements
    assert "_reg[" not in big.source
    np.testing.assert_allclose(big(a, b), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_register_tile_refuses_an_index_that_collides():
    """Two inner iterations that accumulate into one element cannot get two registers."""
    from search.codegen_c import register_tile
    from search.expr import Bin, Const, Var
    from search.lower import Buffer, For, Store

    out = Buffer("C", (4, 4), "output")

    def nest(index):
        st = Store(out, index, Const(1.0), "sum", "C")
        return For("k", 8, "none", [For("a", 2, "unroll", [For("b", 2, "vectorize", [st])])])

    ok = Bin("+", Bin("*", Var("a"), Const(4, True)), Var("b"))
    clash = Bin("+", Var("a"), Var("b"))
    assert register_tile(nest(ok)) is not None
    assert register_tile(nest(clash)) is None
    assert register_tile(nest(Bin("+", ok, Var("k")))) is None  # k is not a reduction loop here


def test_random_schedules_exercise_register_tiles():
    """The property test above covers the register-tile path: some sampled matmul schedules use it."""
    from search.backend import CBackend
    from search.schedule import replay

    task = TASKS["matmul_relu"]
    base, mutants, children = random_schedules(task, seed=7, per_sketch=3)
    sources = [CBackend().source(replay(task.dag, s)) for s in base + mutants + children]
    assert any("_reg[" in src for src in sources)


def test_compile_flags_follow_the_isa_and_are_part_of_the_target():
    """512-bit vectors only where the CPU has AVX-512; the flags are in the target (and so in its
    key), so records measured with other flags are never mixed with these."""
    from search.backend import C_FLAGS, CBackend, compile_flags
    from search.target import target_key

    assert compile_flags(["avx2", "fma"]) == C_FLAGS
    assert "-mprefer-vector-width=512" in compile_flags(["avx2", "avx512f"])
    t = CBackend().target()
    assert tuple(t["cflags"]) == compile_flags(t["isa"])
    assert target_key({**t, "cflags": list(C_FLAGS) + ["-O2"]}) != target_key(t)


def _processes_mentioning(text: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    out.append(pid)
        except OSError:
            continue
    return out


def test_a_build_timeout_kills_the_compiler_and_its_children(tmp_path):
    """A compile past its timeout is an error record, and no cc1 is left running (the gcc
    driver's child once kept a core busy for minutes, slowing every later measurement)."""
    heavy = "float kernel(float* a) {\n  float s = 0;\n" + "".join(
        f"  s += a[{i}] * a[{i + 1}] / (a[{i + 2}] + s);\n" for i in range(40000)) + "  return s;\n}\n"
    backend = CBackend(workdir=str(tmp_path))
    res = backend.build([heavy], timeout_s=0.5)
    assert res[0].error is not None and res[0].error.startswith("build timeout")
    time.sleep(0.3)
    assert _processes_mentioning(str(tmp_path)) == []
