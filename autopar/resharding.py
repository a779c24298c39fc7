"""Cost of converting a tensor from one layout to another on a 2-D mesh.

Moves between layouts: slicing (add a mesh axis as the minor-most split of a dim: local,
free), all-gather (drop the minor-most axes of dims), all-to-all (move one dim's minor-most
axis to become another dim's minor-most axis). `reshard_cost` runs a shortest-path search
over these moves, so it returns the cheapest sequence and its predicted collectives: 0 for
equal layouts or pure additions, one all-gather for pure removals, one all-to-all for
moving an axis between dims, and at worst all-gather-then-slice.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any

from rockmate.graph.op_graph import TensorSpec
from autopar.sharding_spec import Collective, DimSharding, is_valid
from autopar.strategies.layouts import collective_s, mesh_shape_of


def reshard_cost(src: DimSharding, dst: DimSharding, tensor: TensorSpec, mesh: Any,
                 tables: dict | None = None) -> tuple[float, tuple[Collective, ...]]:
    """Seconds and collectives to turn `tensor` laid out as `src` into `dst`.

    Pure apart from `tables`: a planning run's `ShardingCosts` passes one dict per mesh to
    keep each source layout's shortest-path table, which answers every target at once."""
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
    fast = _gather_only(src, dst, tensor.shape, tensor.itemsize, mesh, ms)
    if fast is not None:
        return fast
    sig, full = _signature(tensor.shape, tensor.itemsize, ms)
    key = (src, sig, full)
    table = None if tables is None else tables.get(key)
    if table is None:
        table = _shortest_paths(src, sig, full, mesh, ms)
        if tables is not None:
            tables[key] = table
    return table[dst]


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return a[:n]


def _gather_only(src, dst, shape, isz, mesh, ms) -> tuple[float, tuple[Collective, ...]] | None:
    """Closed form when no axis moves between dims: slice every dim that only gains splits,
    all-gather the dropped axes (together, or one at a time with slicing in between,
    whichever is cheaper), slice the rest. None when an axis of dst comes from elsewhere."""
    common = tuple(_common_prefix(s, d) for s, d in zip(src, dst))
    tails = {d: s[len(c):] for d, (s, c) in enumerate(zip(src, common)) if len(s) > len(c)}
    gone = tuple(sorted(a for t in tails.values() for a in t))
    if {a for d, c in zip(dst, common) for a in d[len(c):]} & set(gone):
        return None

    def clean(state):  # free slicing of every dim that is a prefix of its target
        return tuple(dst[d] if dst[d][:len(x)] == x else x for d, x in enumerate(state))

    def drop(state, axes):  # the gather's result: a gathered dim is sliced only afterwards
        return tuple(tuple(a for a in x if a not in axes) for x in state)

    start = clean(src)
    options = [(Collective("all-gather", _bytes(shape, drop(start, gone), isz, ms), gone),)]
    if len(gone) == 2:
        for first in gone:
            if not any(x and x[-1] == first for x in start):
                continue  # only a dim's minor-most split can be gathered alone
            mid = drop(start, (first,))
            options.append((Collective("all-gather", _bytes(shape, mid, isz, ms), (first,)),
                            Collective("all-gather", _bytes(shape, drop(clean(mid), gone), isz, ms),
                                       tuple(a for a in gone if a != first))))
    costs = [sum(collective_s(mesh, c) for c in cs) for cs in options]
    i = min(range(len(options)), key=costs.__getitem__)
    return float(costs[i]), options[i]


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


def _signature(shape, isz: int, ms) -> tuple[tuple, float]:
    """What the search depends on: each dim's divisibility by the mesh axes, and the bytes."""
    sig = tuple((d % ms[0] == 0, d % ms[1] == 0, d % (ms[0] * ms[1]) == 0) for d in shape)
    full = float(isz)
    for d in shape:
        full *= d
    return sig, full


def _shortest_paths(src, sig, full, mesh, ms) -> dict[tuple, tuple[float, tuple[Collective, ...]]]:
    """Dijkstra over layouts from `src` to every layout reachable from it (all valid ones)."""
    ndim = len(sig)

    def fits(d: int, axes: tuple[int, ...]) -> bool:
        return not axes or (sig[d][2] if len(axes) == 2 else sig[d][axes[0]])

    def nbytes(state) -> float:
        k = 1
        for x in state:
            for a in x:
                k *= ms[a]
        return full / k

    def neighbours(cur):
        # slice: add an unused axis as the minor-most split of a dim (free)
        used = {a for x in cur for a in x}
        for a in range(len(ms)):
            if a in used:
                continue
            for d in range(ndim):
                if fits(d, cur[d] + (a,)):
                    yield cur[:d] + (cur[d] + (a,),) + cur[d + 1:], None
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
                yield nxt_t, ("all-gather", nbytes(nxt_t), tuple(sorted(gone)))
        # all-to-all: move a dim's minor-most axis to the minor end of another dim
        for d1 in range(ndim):
            if not cur[d1]:
                continue
            a = cur[d1][-1]
            for d2 in range(ndim):
                if d2 == d1 or not fits(d2, cur[d2] + (a,)):
                    continue
                nxt = list(cur)
                nxt[d1] = cur[d1][:-1]
                nxt[d2] = cur[d2] + (a,)
                yield tuple(nxt), ("all-to-all", nbytes(cur), (a,))

    memo: dict[tuple, float] = {}

    def cost_of(c: tuple) -> float:
        t = memo.get(c)
        if t is None:
            t = memo[c] = collective_s(mesh, Collective(*c))
        return t

    best = {src: 0.0}
    done: dict[tuple, tuple[float, tuple[Collective, ...]]] = {}
    heap = [(0.0, 0, src, ())]
    tie = itertools.count(1)
    while heap:
        cost, _, cur, path = heapq.heappop(heap)
        if cur in done:
            continue
        done[cur] = (float(sum(cost_of(c) for c in path)), tuple(Collective(*c) for c in path))
        for nxt, c in neighbours(cur):
            # prefer fewer collectives on ties (a free slice counts nothing)
            nc = cost if c is None else cost + cost_of(c) + 1e-15
            if nc < best.get(nxt, float("inf")):
                best[nxt] = nc
                heapq.heappush(heap, (nc, next(tie), nxt, path if c is None else path + (c,)))
    return done
