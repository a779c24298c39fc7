"""Cut a traced loss function into pipeline stages (contiguous equation ranges).

Each stage becomes a pure function `(params, batch, acts) -> outs` that evaluates its
equations; values produced in one stage and read in a later one are the activations sent
between stages. The last stage outputs the scalar loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from jax.extend import core as jcore


@dataclass(frozen=True)
class StageSpec:
    """One stage of a cut loss: equations [eqn_start, eqn_end) and what flows in and out.

    `param_leaves`/`batch_leaves` are positions in the loss jaxpr's invars; `in_acts`
    are variables produced by earlier stages, `out_acts` variables read by later stages
    (for the last stage: the loss).
    """

    index: int
    eqn_start: int
    eqn_end: int
    param_leaves: tuple[int, ...]
    batch_leaves: tuple[int, ...]
    in_acts: tuple[Any, ...]
    out_acts: tuple[Any, ...]


def is_float(aval: Any) -> bool:
    """Whether a value can carry a gradient."""
    import jax.numpy as jnp

    return bool(jnp.issubdtype(aval.dtype, jnp.floating))


def boundaries_from_stage_of_eqn(stage_of_eqn: Sequence[int]) -> list[int]:
    """[0, e1, e2, ..., n]: equation index where each stage starts, plus the end."""
    cuts = [0]
    for i in range(1, len(stage_of_eqn)):
        if stage_of_eqn[i] < stage_of_eqn[i - 1]:
            raise ValueError("stage assignment must be non-decreasing along the equations")
        if stage_of_eqn[i] != stage_of_eqn[i - 1]:
            cuts.append(i)
    return cuts + [len(stage_of_eqn)]


def split_loss(jaxpr: Any, cuts: Sequence[int], diff_mask: Sequence[bool]) -> list[StageSpec]:
    """Stages of `jaxpr` (a loss with one scalar output) cut at equation indices `cuts`.

    `cuts` = [0, c1, ..., n] with strictly increasing entries; `diff_mask[i]` says whether
    invar i is a differentiated parameter (else it is batch data).
    """
    cuts = list(cuts)
    if cuts[0] != 0 or cuts[-1] != len(jaxpr.eqns) or any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"bad stage cuts {cuts} for a loss of {len(jaxpr.eqns)} equations")
    loss_var = jaxpr.outvars[0]
    if not isinstance(loss_var, jcore.Var) or loss_var in set(jaxpr.invars):
        raise ValueError("the loss must be computed from its inputs by at least one operation")
    num_stages = len(cuts) - 1
    producer: dict[Any, int] = {}
    readers: list[list[Any]] = []
    for s in range(num_stages):
        read = []
        for eqn in jaxpr.eqns[cuts[s]:cuts[s + 1]]:
            read += [v for v in eqn.invars if isinstance(v, jcore.Var)]
            for v in eqn.outvars:
                if not isinstance(v, jcore.DropVar):
                    producer[v] = s
        readers.append(read)
    readers[-1] = readers[-1] + [loss_var]
    invar_pos = {v: i for i, v in enumerate(jaxpr.invars)}
    in_acts: list[list[Any]] = [[] for _ in range(num_stages)]
    out_acts: list[list[Any]] = [[] for _ in range(num_stages)]
    leaves: list[set[int]] = [set() for _ in range(num_stages)]
    for s, read in enumerate(readers):
        for v in read:
            if v in invar_pos:
                leaves[s].add(invar_pos[v])
            elif v in producer and producer[v] < s and v not in in_acts[s]:
                in_acts[s].append(v)
                if v not in out_acts[producer[v]]:
                    out_acts[producer[v]].append(v)
    out_acts[-1] = [loss_var]
    return [StageSpec(s, cuts[s], cuts[s + 1],
                      tuple(sorted(i for i in leaves[s] if diff_mask[i])),
                      tuple(sorted(i for i in leaves[s] if not diff_mask[i])),
                      tuple(in_acts[s]), tuple(out_acts[s]))
            for s in range(num_stages)]


def eval_eqns(eqns: Sequence[Any], env: dict[Any, Any]) -> None:
    """Evaluate equations in order, reading and writing `env` (var -> value)."""
    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    from autopar.boundary import is_stage_boundary

    for eqn in eqns:
        if is_stage_boundary(eqn):          # identity: pass the values through
            for v, x in zip(eqn.outvars, map(read, eqn.invars)):
                if not isinstance(v, jcore.DropVar):
                    env[v] = x
            continue
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = x


def stage_function(closed_jaxpr: Any, spec: StageSpec) -> Callable[..., tuple[Any, ...]]:
    """`fn(params, batch, acts) -> outs`: the stage's equations as a pure function.

    `params`/`batch` follow `spec.param_leaves`/`spec.batch_leaves`, `acts` follows
    `spec.in_acts`, and the result follows `spec.out_acts`.
    """
    jaxpr = closed_jaxpr.jaxpr
    consts = dict(zip(jaxpr.constvars, closed_jaxpr.consts))
    eqns = jaxpr.eqns[spec.eqn_start:spec.eqn_end]

    def fn(params, batch, acts):
        env = dict(consts)
        env.update(zip((jaxpr.invars[i] for i in spec.param_leaves), params))
        env.update(zip((jaxpr.invars[i] for i in spec.batch_leaves), batch))
        env.update(zip(spec.in_acts, acts))
        eval_eqns(eqns, env)
        return tuple(env[v] for v in spec.out_acts)

    return fn


def stage_train_function(closed_jaxpr: Any, eqn_range: tuple[int, int],
                         diff_mask: Sequence[bool]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The forward + backward of one candidate stage (equations [start, end)) as a plain
    function with abstract example arguments, for pricing it with another planner:
    `fn(params, batch, acts_float, acts_int, cotangents) -> (outputs, (param grads,
    activation grads))`; the arguments are `jax.ShapeDtypeStruct`s."""
    import jax

    jaxpr = closed_jaxpr.jaxpr
    a, b = eqn_range
    specs = split_loss(jaxpr, sorted({0, a, b, len(jaxpr.eqns)}), diff_mask)
    spec = next(sp for sp in specs if sp.eqn_start == a)
    fn = stage_function(closed_jaxpr, spec)
    float_in = [is_float(v.aval) for v in spec.in_acts]
    float_out = [is_float(v.aval) for v in spec.out_acts]

    def train(params, batch, acts_float, acts_int, cts):
        def f(p, af):
            fl, it = iter(af), iter(acts_int)
            acts = tuple(next(fl) if m else next(it) for m in float_in)
            return tuple(o for o, m in zip(fn(p, batch, acts), float_out) if m)
        outs, vjp_fn = jax.vjp(f, params, acts_float)
        return outs, vjp_fn(cts)

    sds = lambda v: jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
    args = (tuple(sds(jaxpr.invars[i]) for i in spec.param_leaves),
            tuple(sds(jaxpr.invars[i]) for i in spec.batch_leaves),
            tuple(sds(v) for v, m in zip(spec.in_acts, float_in) if m),
            tuple(sds(v) for v, m in zip(spec.in_acts, float_in) if not m),
            tuple(sds(v) for v, m in zip(spec.out_acts, float_out) if m))
    return train, args
