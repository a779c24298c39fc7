"""Per-statement features of a lowered program, as plain dicts for `cost_model`."""
from __future__ import annotations

from .expr import Expr, Var, loads, variables
from .codegen_c import register_tile
from .lower import Alloc, For, Program, Store, _linear, store_op_counts, trip_count
from .prior import statement_estimates


def _access(index: Expr, loops: list[For]) -> tuple[list[bool], int]:
    """Which enclosing loops an access depends on, and its stride along the innermost loop."""
    used = variables(index)
    uses = [lp.var in used for lp in loops]
    stride = 0
    if loops and uses[-1]:
        coeffs, _ = _linear(index)
        stride = abs(coeffs.get(Var(loops[-1].var), 0)) or 1  # 1 when used through a fused div/mod
    return uses, stride


def _touched(uses: list[bool], loops: list[For], first: int = 0) -> int:
    """Distinct elements touched by loops[first:] (product of the extents the access depends on)."""
    n = 1
    for u, lp in zip(uses[first:], loops[first:]):
        if u:
            n *= lp.extent
    return n


def _statement(st: Store, loops: list[For], local_bytes: int, register_elems: int = 0) -> dict[str, float]:
    trips = trip_count(loops)
    ops = store_op_counts(st)
    f: dict[str, float] = {f"flops_{k}": v * trips for k, v in ops.items()}
    f["flops_total"] = sum(ops.values()) * trips
    f["is_reduction"] = float(st.reduce_op is not None)
    f["is_init"] = float(not st.reduce_op and not loads(st.value) and st.buffer.scope != "output")
    f["n_loops"] = len(loops)
    f["iterations"] = trips
    f["innermost_extent"] = loops[-1].extent if loops else 1
    f["outer_parallel_extent"] = next((lp.extent for lp in loops if lp.ann == "parallel"), 0)
    f["vector_len"] = next((lp.extent for lp in loops if lp.ann == "vectorize"), 0)
    unrolled = [lp.extent for lp in loops if lp.ann == "unroll"]
    f["n_unrolled_loops"] = len(unrolled)
    p = 1
    for e in unrolled:
        p *= e
    f["unroll_product"] = p if unrolled else 0
    accesses = [(st.buffer.name, st.buffer.scope, st.index)] + [(ld.tensor, "", ld.index[0]) for ld in loads(st.value)]
    total, reuse, strides = 0, [], []
    inner = [0, 0, 0, 0]
    for name, scope, ix in accesses:
        uses, s = _access(ix, loops)
        n = _touched(uses, loops)
        total += 4 * n
        reuse.append(trips / max(n, 1))
        strides.append(s)
        for k in range(4):
            inner[k] += 4 * _touched(uses, loops, max(0, len(loops) - k - 1))
    f["bytes_total"] = total
    for k in range(4):
        f[f"bytes_inner{k + 1}"] = inner[k]
    f["n_buffers"] = len({a[0] for a in accesses})
    f["n_local_buffers"] = float(st.buffer.scope == "local")
    f["reuse_min"], f["reuse_max"] = min(reuse), max(reuse)
    f["innermost_stride_max"] = max(strides)
    f["innermost_stride_nonunit"] = sum(1 for s in strides if s > 1)
    f["write_innermost_stride"] = strides[0]
    f["local_alloc_bytes"] = local_bytes
    f["arithmetic_intensity"] = f["flops_total"] / max(total, 1)
    f["register_tile_elems"] = register_elems
    f["register_tile_vectors"] = -(-register_elems // 16)
    return f


def statement_features(prog: Program) -> list[dict[str, float]]:
    """One feature dict per store statement, in program order (a statement the C printer keeps in a
    register tile says how many elements the tile has). Each also carries the program's size
    (`out_elems`, `io_bytes`), which the cost model divides work and traffic by, and its analytic
    time estimate `est_s` (search.prior), which the cost model starts its ranking from, and
    `backend: "c"` (cost_model.features.backend_of keeps models to one backend)."""
    out: list[dict[str, float]] = []
    size = {"out_elems": float(sum(b.size for b in prog.args if b.scope == "output")),
            "io_bytes": float(4 * sum(b.size for b in prog.args)), "backend": "c"}

    def walk(nodes, loops: list[For], local_bytes: int, register_elems: int) -> None:
        for n in nodes:
            if isinstance(n, Alloc):
                local_bytes += 4 * n.buffer.size
            elif isinstance(n, For):
                tile = register_tile(n) if n.ann != "parallel" and not register_elems else None
                elems = register_elems
                if tile is not None:
                    elems = 1
                    for lp in tile[0]:
                        elems *= lp.extent
                walk(n.body, loops + [n], local_bytes, elems)
            elif isinstance(n, Store):
                out.append({**_statement(n, loops, local_bytes, register_elems), **size})

    walk(prog.body, [], 0, 0)
    for f, est in zip(out, statement_estimates(prog)):
        f["est_s"] = est
    return out
