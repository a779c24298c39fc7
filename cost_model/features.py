"""Program features for cost models. A program is a list of per-statement feature dicts
(names in STATEMENT_FEATURES, produced by the search's lowering); models see one fixed-size
vector per program: the sum and the max over statements of log-scaled statement features.

Work and traffic are made relative to the task's size when a statement carries the
normalisers in NORMALISERS (flops and iterations per output element, bytes per byte of the
program's inputs and outputs): within one task that is a constant factor, which a ranking
model does not see, and across tasks it lets a model trained on one operator rank another's
programs (cross-task transfer)."""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

STATEMENT_FEATURES: tuple[str, ...] = (
    # floating-point work, by kind, times the trip count of the enclosing loops
    "flops_add", "flops_mul", "flops_div", "flops_cmp", "flops_math", "flops_total",
    "is_reduction", "is_init",
    # loop nest
    "n_loops", "iterations", "innermost_extent", "outer_parallel_extent",
    "vector_len", "unroll_product", "n_unrolled_loops",
    # memory: bytes touched by the whole nest and by the innermost 1..4 loops, reuse, strides
    "bytes_total", "bytes_inner1", "bytes_inner2", "bytes_inner3", "bytes_inner4",
    "n_buffers", "n_local_buffers", "reuse_min", "reuse_max",
    "innermost_stride_max", "innermost_stride_nonunit", "write_innermost_stride",
    "local_alloc_bytes", "arithmetic_intensity",
    # accumulator kept in registers across the innermost reduction loop (0 = none)
    "register_tile_elems", "register_tile_vectors",
)

# Pallas programs: one "statement" per kernel (pallas_call), from search.features_pallas
PALLAS_FEATURES: tuple[str, ...] = (
    "flops_total", "flops_math", "dot_share", "recompute",
    "programs", "waves", "block_elems", "n_stages", "local_elems", "reduce_steps", "padding",
    "bytes_read", "bytes_written", "bytes_per_program", "arithmetic_intensity",
)

# a statement's "backend" key says which list its features follow ("c" when it has none)
BACKEND_FEATURES: dict[str, tuple[str, ...]] = {"c": STATEMENT_FEATURES, "pallas": PALLAS_FEATURES}

Statement = Mapping[str, float]

# normaliser -> the extensive features divided by it
NORMALISERS: dict[str, tuple[str, ...]] = {
    "out_elems": ("flops_add", "flops_mul", "flops_div", "flops_cmp", "flops_math", "flops_total", "iterations"),
    "io_bytes": ("bytes_total", "bytes_read", "bytes_written"),
}
_DIVISOR = {f: n for n, fs in NORMALISERS.items() for f in fs}


def _value(s: Statement, k: str) -> float:
    x = float(s.get(k, 0.0))
    d = _DIVISOR.get(k)
    return x / float(s[d]) if d is not None and s.get(d) else x


def _scale(x: float) -> float:
    return math.copysign(math.log2(1.0 + abs(x)), x)


def backend_of(programs: Sequence[Sequence[Statement]]) -> str:
    """The one backend all statements of `programs` come from ("c" for none); ValueError when
    they mix backends, whose features mean different things and whose latencies do not compare."""
    found = {str(s.get("backend", "c")) for p in programs for s in p} or {"c"}
    if len(found) > 1:
        raise ValueError(f"programs of several backends {sorted(found)} cannot share a cost model; "
                         "train one model per backend")
    backend = found.pop()
    if backend not in BACKEND_FEATURES:
        raise ValueError(f"unknown backend {backend!r}; known: {sorted(BACKEND_FEATURES)}")
    return backend


def program_vector(statements: Sequence[Statement]) -> np.ndarray:
    """Sum and max of log-scaled statement features, plus the statement count (features of the
    statements' backend)."""
    names = BACKEND_FEATURES[backend_of([statements])]
    if not statements:
        return np.zeros(2 * len(names) + 1, dtype=np.float32)
    m = np.array([[_scale(_value(s, k)) for k in names] for s in statements], dtype=np.float32)
    return np.concatenate([m.sum(0), m.max(0), [len(statements)]]).astype(np.float32)


def prior_margin(programs: Sequence[Sequence[Statement]]) -> np.ndarray:
    """-log2 of each program's analytic time estimate (the sum of its statements' `est_s`):
    the score a ranking model starts from. 0 for a program without estimates."""
    out = np.zeros(len(programs), dtype=np.float32)
    for i, p in enumerate(programs):
        est = sum(float(s.get("est_s", 0.0)) for s in p)
        if est > 0:
            out[i] = -math.log2(est)
    return out


def feature_matrix(programs: Sequence[Sequence[Statement]]) -> np.ndarray:
    """One row per program; all of one backend (ValueError otherwise)."""
    names = BACKEND_FEATURES[backend_of(programs)]
    if not programs:
        return np.zeros((0, 2 * len(names) + 1), dtype=np.float32)
    return np.stack([program_vector(p) for p in programs])
