"""Which ops of a planned program a tuned kernel can serve, with each device's local shapes.

A site is a float32 `dot_general` (dense layers forward, and the matmuls of their backward:
dX = dY . W^T, dW = X^T . dY; attention's batched products, forward and backward) whose
contracting dimensions are whole on every device under the plan and whose batch dimensions
are split alike on both operands, so that each device computes its block of the output
alone: its operands, transposed to (batch, free, contracting) and (batch, contracting,
free), are a [B, M, K] and a [B, K, N] array, i.e. the search's `matmul` task (no batch
dimensions) or `batch_matmul` task.

A convolution site is a float32 `conv_general_dilated` without dilations or groups, with
one stride and one symmetric padding for both spatial dims (the forward of a stride-1
"SAME" conv and its weight gradient, in any layout): its operands, transposed to NHWC and
HWIO, are the search's `conv2d` task, on every device whose batch (and output channels)
the plan splits but not its spatial dims or input channels.

Every site knows its search task (`task()`) and how to run its op on one device's blocks
through a kernel (`local(kernel)`).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.plan import KernelTask
from autopar.sharding_spec import DimSharding, local_shape, replicated
from rockmate.graph import OpGraph


@dataclass(frozen=True)
class SiteOperands:
    """What every site has: its op, and the local shape and layout of its two operands and
    its output on each device."""

    op: int
    lhs_local: tuple[int, ...]
    rhs_local: tuple[int, ...]
    out_local: tuple[int, ...]
    lhs_spec: DimSharding
    rhs_spec: DimSharding
    out_spec: DimSharding


@dataclass(frozen=True)
class MatmulSite(SiteOperands):
    """One dot_general served as a local [B, M, K] x [B, K, N] (batched) matmul on every device."""

    lhs_perm: tuple[int, ...]          # lhs transposed to (batch..., free..., contracting...)
    rhs_perm: tuple[int, ...]          # rhs transposed to (batch..., contracting..., free...)
    B: int | None                      # None: no batch dimensions (a plain matmul)
    M: int
    N: int
    K: int

    def task(self) -> Any:
        """The search task of the local (batched) matmul."""
        from search import Task

        if self.B is None:
            return Task.matmul(self.M, self.N, self.K)
        return Task.batch_matmul(self.B, self.M, self.N, self.K)

    def local(self, kernel: Any) -> Any:
        """The op on one device's operands, through `kernel` (a custom call)."""
        from autopar.ffi_kernels import call_kernel

        batch = () if self.B is None else (self.B,)

        def run(lhs, rhs):
            a = lhs.transpose(self.lhs_perm).reshape(*batch, self.M, self.K)
            b = rhs.transpose(self.rhs_perm).reshape(*batch, self.K, self.N)
            return call_kernel(kernel, a, b).reshape(self.out_local)
        return run


@dataclass(frozen=True)
class ConvSite(SiteOperands):
    """One conv_general_dilated served as a local NHWC x HWIO conv2d on every device."""

    lhs_perm: tuple[int, ...]          # lhs transposed to NHWC
    rhs_perm: tuple[int, ...]          # rhs transposed to HWIO
    out_perm: tuple[int, ...]          # the kernel's NHWC output transposed to the op's layout
    N: int
    H: int
    W: int
    CI: int
    CO: int
    KH: int
    KW: int
    stride: int
    pad: int

    def task(self) -> Any:
        from search import Task

        return Task.conv2d(self.N, self.H, self.W, self.CI, self.CO, self.KH, self.KW, self.stride, self.pad)

    def local(self, kernel: Any) -> Any:
        from autopar.ffi_kernels import call_kernel

        def run(lhs, rhs):
            return call_kernel(kernel, lhs.transpose(self.lhs_perm), rhs.transpose(self.rhs_perm)).transpose(
                self.out_perm)
        return run


Site = MatmulSite | ConvSite


def kernel_sites(graph: OpGraph, var_specs: dict[int, DimSharding], mesh_shape: tuple[int, int]) -> list[Site]:
    """Every op of `graph` a local kernel can serve under `var_specs`, in program order."""
    return sorted(matmul_sites(graph, var_specs, mesh_shape) + conv_sites(graph, var_specs, mesh_shape),
                  key=lambda s: s.op)


def conv_sites(graph: OpGraph, var_specs: dict[int, DimSharding], mesh_shape: tuple[int, int]) -> list[ConvSite]:
    """The convolutions of `graph` a local conv2d kernel can serve (see the module doc)."""
    sites = []
    for op in graph.ops:
        if op.name != "conv_general_dilated" or len(op.inputs) != 2 or any(v in graph.literals for v in op.inputs):
            continue
        p = op.params
        lhs, rhs, out = (graph.vars[v] for v in (*op.inputs, op.outputs[0]))
        if {lhs.dtype, rhs.dtype, out.dtype} != {"float32"} or len(lhs.shape) != 4:
            continue
        pads = {tuple(x) for x in p["padding"]}
        if (set(p["lhs_dilation"]) != {1} or set(p["rhs_dilation"]) != {1} or p["feature_group_count"] != 1
                or p["batch_group_count"] != 1 or len(set(p["window_strides"])) != 1 or len(pads) != 1
                or len(set(next(iter(pads)))) != 1):
            continue
        dn = p["dimension_numbers"]
        ln, lc, *lsp = dn.lhs_spec
        ro, ri, *rsp = dn.rhs_spec
        on, oc, *osp = dn.out_spec
        spec = lambda v, nd: var_specs.get(v, replicated(nd))
        ls, rs = spec(op.inputs[0], 4), spec(op.inputs[1], 4)
        if any(ls[d] for d in (lc, *lsp)) or any(rs[d] for d in (ri, *rsp)):
            continue                   # split channels or spatial dims: partial sums or halos, left to XLA
        out_spec = [()] * 4
        out_spec[on], out_spec[oc] = ls[ln], rs[ro]
        used = [a for axes in out_spec for a in axes]
        if len(used) != len(set(used)):
            continue
        lhs_local, rhs_local = local_shape(lhs.shape, ls, mesh_shape), local_shape(rhs.shape, rs, mesh_shape)
        canon = (on, *osp, oc)         # output dims in NHWC order
        out_local = [0] * 4
        n_, h_, w_, ci = (lhs_local[d] for d in (ln, *lsp, lc))
        kh, kw, co = rhs_local[rsp[0]], rhs_local[rsp[1]], rhs_local[ro]
        stride, pad = p["window_strides"][0], p["padding"][0][0]
        oh, ow = (h_ + 2 * pad - kh) // stride + 1, (w_ + 2 * pad - kw) // stride + 1
        if min(oh, ow) < 1:
            continue
        for d, n in zip(canon, (n_, oh, ow, co)):
            out_local[d] = n
        sites.append(ConvSite(
            op=op.index, lhs_perm=(ln, *lsp, lc), rhs_perm=(*rsp, ri, ro), out_perm=tuple(int(x) for x in np.argsort(canon)),
            N=n_, H=h_, W=w_, CI=ci, CO=co, KH=kh, KW=kw, stride=stride, pad=pad,
            lhs_local=lhs_local, rhs_local=rhs_local, out_local=tuple(out_local),
            lhs_spec=ls, rhs_spec=rs, out_spec=tuple(out_spec)))
    return sites


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


def kernel_tasks(sites: list[Site]) -> tuple[KernelTask, ...]:
    """The distinct search tasks of `sites`, each with how many sites it serves, largest first."""
    every = [s.task() for s in sites]
    tasks = {t.workload_key: t for t in every}
    counts = Counter(t.workload_key for t in every)
    found = [KernelTask(workload_key=k, op=t.op, sizes=tuple((n, int(v)) for n, v in t.params), ops=counts[k])
             for k, t in tasks.items()]
    return tuple(sorted(found, key=lambda kt: (-tasks[kt.workload_key].flops * kt.ops, kt.workload_key)))


def search_task(kt: KernelTask) -> Any:
    """The search.Task a plan's KernelTask names."""
    from search import Task

    return Task.make(kt.op, **dict(kt.sizes))
