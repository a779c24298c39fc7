"""Cost of converting a tensor from one layout to another on a 2-D mesh.

Moves between layouts: slicing (add a mesh axis as the minor-most split of a dim: local,
free), all-gather (drop the minor-most axes of dims), all-to-all (move one dim's minor-most
axis to become another dim's minor-most axis). `reshard_cost` runs a shortest-path search
over these moves, so it returns the cheapest sequence and its predicted collectives: 0 for
equal layouts or pure additions, one all-gather for pure removals, one all-to-all for
moving an axis between dims, and at worst all-gather-then-slice.
"""
from __future__ import annotations

import functools
import heapq
import itertools
from typing import Any

from autopar.graph.op_graph import TensorSpec
from autopar.sharding_spec import Collective, DimSharding, is_valid
from autopar.strategies.layouts import collective_s, itemsize, mesh_shape_of


def reshard_cost(src: DimSharding, dst: DimSharding, tensor: TensorSpec, mesh: Any
                 ) -> tuple[float, tuple[Collective, ...]]:
    """Seconds and collectives to turn `tensor` laid out as `src` into `dst`."""
    src, dst = _canon(src), _canon(dst)
    if src == dst:
        return 0.0, ()
    ms = mesh_shape_of(mesh)
    if len(src) != tensor.ndim or len(dst) != tensor.ndim:
        raise ValueError(f"autopar: layouts {src} -> {dst} do not match the rank of tensor shape {tensor.shape}")
    for name, s in (("source", src), ("target", dst)):
        if not is_valid(tensor.shape, s, ms):
            raise ValueError(f"autopar: {name} layout {s} is not valid for shape {tensor.shape} on mesh {ms}")
    if all(d[:len(s)] == s for s, d in zip(src, dst)):
        return 0.0, ()
    return _search(src, dst, tensor.shape, itemsize(tensor.dtype), _mesh_key(mesh), ms)


_meshes: dict[Any, Any] = {}


def _mesh_key(mesh: Any) -> Any:
    try:
        hash(mesh)
        key = mesh
    except TypeError:
        key = ("id", id(mesh))
    _meshes[key] = mesh
    return key


def _canon(spec: DimSharding) -> DimSharding:
    return tuple(tuple(x) for x in spec)


def _bytes(shape, spec, isz: int, ms) -> float:
    n = isz
    for d, axes in zip(shape, spec):
        k = 1
        for a in axes:
            k *= ms[a]
        n *= d // k
    return float(n)


@functools.lru_cache(maxsize=65536)
def _search(src, dst, shape, isz, mkey, ms) -> tuple[float, tuple[Collective, ...]]:
    mesh = _meshes[mkey]
    axes = [a for a, s in enumerate(ms) if s > 1]
    ndim = len(shape)

    def neighbours(cur):
        # slice: add an unused axis as the minor-most split of a dim (free)
        used = {a for x in cur for a in x}
        for a in axes:
            if a in used:
                continue
            for d in range(ndim):
                nxt = cur[:d] + (cur[d] + (a,),) + cur[d + 1:]
                if is_valid(shape, nxt, ms):
                    yield nxt, None
        # all-gather: drop a set of minor-most axes (one collective over all of them)
        tails = [(d, k) for d in range(ndim) for k in range(1, len(cur[d]) + 1)]
        for r in range(1, len(tails) + 1):
            for combo in itertools.combinations(tails, r):
                dims = [d for d, _ in combo]
                if len(set(dims)) != len(dims):
                    continue
                nxt = list(cur)
                gone: list[int] = []
                for d, k in combo:
                    gone += list(cur[d][len(cur[d]) - k:])
                    nxt[d] = cur[d][:len(cur[d]) - k]
                nxt_t = tuple(nxt)
                c = Collective("all-gather", _bytes(shape, nxt_t, isz, ms), tuple(sorted(gone)))
                yield nxt_t, c
        # all-to-all: move a dim's minor-most axis to the minor end of another dim
        for d1 in range(ndim):
            if not cur[d1]:
                continue
            a = cur[d1][-1]
            for d2 in range(ndim):
                if d2 == d1:
                    continue
                nxt = list(cur)
                nxt[d1] = cur[d1][:-1]
                nxt[d2] = cur[d2] + (a,)
                nxt_t = tuple(nxt)
                if is_valid(shape, nxt_t, ms):
                    yield nxt_t, Collective("all-to-all", _bytes(shape, cur, isz, ms), (a,))

    best = {src: 0.0}
    heap = [(0.0, 0, src, ())]
    tie = itertools.count(1)
    while heap:
        cost, _, cur, path = heapq.heappop(heap)
        if cur == dst:
            return float(sum(collective_s(mesh, c) for c in path)), path
        if cost > best.get(cur, float("inf")):
            continue
        for nxt, c in neighbours(cur):
            step = 0.0 if c is None else collective_s(mesh, c)
            # prefer fewer collectives on ties (a free slice counts nothing)
            nc = cost + step + (0.0 if c is None else 1e-15)
            if nc < best.get(nxt, float("inf")):
                best[nxt] = nc
                heapq.heappush(heap, (nc, next(tie), nxt, path if c is None else path + (c,)))
    raise ValueError(f"autopar: no resharding path from {src} to {dst} for shape {shape}")  # unreachable
