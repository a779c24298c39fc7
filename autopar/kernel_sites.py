"""Which ops of a planned program a tuned kernel can serve, with each device's local shapes.

A site is a float32 `dot_general` (dense layers forward, and the matmuls of their backward:
dX = dY . W^T, dW = X^T . dY; attention's batched products, forward and backward) whose
contracting dimensions are whole on every device under the plan and whose batch dimensions
are split alike on both operands, so that each device computes its block of the output
alone: its operands, transposed to (batch, free, contracting) and (batch, contracting,
free), are a [B, M, K] and a [B, K, N] array, i.e. the search's `matmul` task (no batch
dimensions) or `batch_matmul` task.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autopar.plan import KernelTask
from autopar.sharding_spec import DimSharding, local_shape, replicated
from rockmate.graph import OpGraph


@dataclass(frozen=True)
class MatmulSite:
    """One dot_general served as a local [B, M, K] x [B, K, N] (batched) matmul on every device."""

    op: int
    lhs_perm: tuple[int, ...]          # lhs transposed to (batch..., free..., contracting...)
    rhs_perm: tuple[int, ...]          # rhs transposed to (batch..., contracting..., free...)
    B: int | None                      # None: no batch dimensions (a plain matmul)
    M: int
    N: int
    K: int
    lhs_local: tuple[int, ...]
    rhs_local: tuple[int, ...]
    out_local: tuple[int, ...]
    lhs_spec: DimSharding
    rhs_spec: DimSharding
    out_spec: DimSharding


def matmul_sites(graph: OpGraph, var_specs: dict[int, DimSharding], mesh_shape: tuple[int, int]) -> list[MatmulSite]:
    """Every op of `graph` a local matmul kernel can serve under `var_specs` (by var id;
    missing: replicated) on a mesh of `mesh_shape`."""
    sites = []
    for op in graph.ops:
        if op.name != "dot_general" or len(op.inputs) != 2 or any(v in graph.literals for v in op.inputs):
            continue
        (lc, rc), (lb, rb) = op.params["dimension_numbers"]
        lhs, rhs, out = (graph.vars[v] for v in (*op.inputs, op.outputs[0]))
        if not lc or {lhs.dtype, rhs.dtype, out.dtype} != {"float32"}:
            continue
        spec = lambda v, nd: var_specs.get(v, replicated(nd))
        ls, rs = spec(op.inputs[0], len(lhs.shape)), spec(op.inputs[1], len(rhs.shape))
        if any(ls[d] for d in lc) or any(rs[d] for d in rc):
            continue                   # a sharded contraction: partial sums, left to XLA
        if any(ls[a] != rs[b] for a, b in zip(lb, rb)):
            continue                   # batch dims split differently: XLA reshards first
        lf = [d for d in range(len(lhs.shape)) if d not in lc and d not in lb]
        rf = [d for d in range(len(rhs.shape)) if d not in rc and d not in rb]
        out_spec = tuple(ls[d] for d in lb) + tuple(ls[d] for d in lf) + tuple(rs[d] for d in rf)
        used = [a for axes in out_spec for a in axes]
        if len(used) != len(set(used)):
            continue                   # both operands split over one mesh axis: not a local block
        lhs_local, rhs_local = local_shape(lhs.shape, ls, mesh_shape), local_shape(rhs.shape, rs, mesh_shape)
        B = math.prod(lhs_local[d] for d in lb) if lb else None
        M = math.prod(lhs_local[d] for d in lf)
        N = math.prod(rhs_local[d] for d in rf)
        K = math.prod(lhs_local[d] for d in lc)
        if min(M, N, K, B or 1) < 1:
            continue
        sites.append(MatmulSite(
            op=op.index, lhs_perm=tuple(lb) + tuple(lf) + tuple(lc), rhs_perm=tuple(rb) + tuple(rc) + tuple(rf),
            B=B, M=M, N=N, K=K, lhs_local=lhs_local, rhs_local=rhs_local,
            out_local=tuple(lhs_local[d] for d in (*lb, *lf)) + tuple(rhs_local[d] for d in rf),
            lhs_spec=ls, rhs_spec=rs, out_spec=out_spec))
    return sites


def site_task(site: MatmulSite) -> Any:
    """The search task of a site's local (batched) matmul."""
    from search import Task

    if site.B is None:
        return Task.matmul(site.M, site.N, site.K)
    return Task.batch_matmul(site.B, site.M, site.N, site.K)


def kernel_tasks(sites: list[MatmulSite]) -> tuple[KernelTask, ...]:
    """The distinct search tasks of `sites`, each with how many sites it serves, largest first."""
    counts: dict[str, tuple[Any, int]] = {}
    for s in sites:
        t = site_task(s)
        counts[t.workload_key] = (t, counts.get(t.workload_key, (t, 0))[1] + 1)
    tasks = [KernelTask(workload_key=k, op=t.op, sizes=tuple((n, int(v)) for n, v in t.params), ops=n)
             for k, (t, n) in counts.items()]
    return tuple(sorted(tasks, key=lambda kt: (-search_task(kt).flops * kt.ops, kt.workload_key)))


def search_task(kt: KernelTask) -> Any:
    """The search.Task a plan's KernelTask names."""
    from search import Task

    return Task.make(kt.op, **dict(kt.sizes))
