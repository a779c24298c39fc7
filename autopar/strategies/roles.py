"""Strategy enumeration from dim roles, shared by gather, scatter and convolution rules.

A role names the dims (one per tensor at most) that are split together when a mesh axis
takes that role. A partial role splits only operands and leaves partial sums, combined by
an all-reduce over that axis or reduce-scattered onto a result dim (the axis becomes that
dim's minor split). Each live mesh axis takes at most one role; two axes on one role make
an S01 split.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

from rockmate.graph.op_graph import TensorSpec
from autopar.sharding_spec import Collective, Strategy, is_transposed, is_valid
from autopar.strategies.layouts import (axes_product, dedupe, live_axes, local_bytes,
                                        make_strategy, mesh_shape_of)


@dataclass(frozen=True)
class Role:
    """Dims split together: (tensor position in ins+outs, dim) pairs. `partial`: the split
    leaves partial sums in the results. `group_size`: the split must divide this number
    (e.g. a grouped convolution's group count)."""

    dims: tuple[tuple[int, int], ...]
    partial: bool = False
    group_size: int | None = None
    scatter_ok: bool = True


def role_strategies(mesh: Any, ins: Sequence[TensorSpec | None], outs: Sequence[TensorSpec],
                    roles: Sequence[Role], flops: float, dtype: str | None = None,
                    split_flops: bool = True) -> list[Strategy]:
    ms = mesh_shape_of(mesh)
    tensors = [*ins, *outs]
    n_in = len(ins)
    axes = live_axes(ms)
    result: list[Strategy] = []
    for choice in itertools.product([None, *range(len(roles))], repeat=len(axes)):
        specs: list[list[tuple[int, ...]] | None] = [
            None if t is None else [() for _ in t.shape] for t in tensors]
        partial_axes: list[int] = []
        ok = True
        for r in set(c for c in choice if c is not None):
            role = roles[r]
            k = axes_product([a for a, c in zip(axes, choice) if c == r], ms)
            if role.group_size is not None and role.group_size % k:
                ok = False
        if not ok:
            continue
        for a, r in zip(axes, choice):
            if r is None:
                continue
            for pos, d in roles[r].dims:
                if specs[pos] is not None:
                    specs[pos][d] += (a,)
            if roles[r].partial:
                partial_axes.append(a)
        base = [None if s is None else tuple(s) for s in specs]
        if not all(t is None or is_valid(t.shape, s, ms) for t, s in zip(tensors, base)):
            continue
        scatterable = all(roles[r].scatter_ok for a, r in zip(axes, choice) if a in partial_axes)
        targets_per_axis = [None, *[(o, d) for o in range(len(outs)) for d in range(outs[o].ndim)]] \
            if scatterable else [None]
        for targets in itertools.product(targets_per_axis, repeat=len(partial_axes)):
            out_specs = [list(base[n_in + o]) for o in range(len(outs))]
            for a, tgt in zip(partial_axes, targets):
                if tgt is not None:
                    out_specs[tgt[0]][tgt[1]] += (a,)
            out_t = [tuple(s) for s in out_specs]
            if any(list(x) != sorted(x) for s in out_t for x in s):
                continue
            if any(t is not None for t in targets) and any(is_transposed(s) for s in out_t):
                # XLA scatters onto a transposed tiling with all-reduces and gathers (measured
                # on the 2x4 test GPT's weight gradients: 2.5x the bytes of the one
                # reduce-scatter priced here);
                # the tiling in mesh order has the same local shapes (`all_layouts`)
                continue
            if not all(is_valid(o.shape, s, ms) for o, s in zip(outs, out_t)):
                continue
            groups: dict[int, tuple[list[int], list[int]]] = {}
            for a, t in zip(partial_axes, targets):
                groups.setdefault(choice[axes.index(a)], ([], []))[0 if t is not None else 1].append(a)
            colls = partial_sum_collectives(outs, out_t, list(groups.values()), ms)
            in_specs = base[:n_in]
            result.append(make_strategy(mesh, ins, outs, in_specs, out_t, flops, colls, dtype=dtype,
                                        split_flops=split_flops))
    return dedupe(result)


def partial_sum_collectives(outs: Sequence[TensorSpec], out_specs: Sequence[tuple],
                            groups: Sequence[tuple[Sequence[int], Sequence[int]]], ms) -> list[Collective]:
    """Collectives combining partial sums, one group per split reduction dim (XLA reduces
    each split dim on its own): first each group's reduce-scatter over its scattered axes,
    then each group's all-reduce over its other axes, on the buffer shrunk by the scatters."""
    all_rs = {a for rs, _ in groups for a in rs}
    applied: set[int] = set()
    colls: list[Collective] = []

    def nbytes() -> float:
        pending = all_rs - applied
        return sum(local_bytes(o, tuple(tuple(a for a in x if a not in pending) for x in s), ms)
                   for o, s in zip(outs, out_specs))

    for rs, _ in groups:
        if rs:
            colls.append(Collective("reduce-scatter", nbytes(), tuple(sorted(rs))))
            applied.update(rs)
    for _, ar in groups:
        if ar:
            colls.append(Collective("all-reduce", nbytes(), tuple(sorted(ar))))
    return colls
