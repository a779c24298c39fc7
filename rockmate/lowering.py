"""Turn a schedule into JAX: nested checkpoint regions over the re-played jaxpr.

Why not plain `jax.checkpoint`: XLA CPU strips optimization barriers early and then CSE
merges the backward's recomputation with the forward (or the scheduler hoists it), so an
unrolled checkpointed model keeps its activations anyway. Here every recomputing region is
a `custom_vjp` whose backward first makes its saved values depend on the incoming
cotangent (`x + 0 * ct[0]`), so the recomputation can neither be CSE'd with the forward
nor start before the cotangent exists. Inside, kept values carry `checkpoint_name` and the
region is `jax.checkpoint` with a `save_only_these_names` policy. Scan blocks stay scans
with a checkpointed body (XLA cannot hoist out of the backward loop).
"""
from __future__ import annotations

import itertools
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from .block_ilp import BlockOption
from .blocks import Block, Chain, block_io
from .graph.evaluate import OutputHook, eval_ops
from .graph.op_graph import OpGraph
from .sequence_dp import Leaf, Schedule, Split

_uid = itertools.count()


def _tie_to_cotangent(vals, ct):
    """vals + 0 * (first element of the first floating cotangent): same values, new data dependence."""
    leaves = [c for c in jax.tree.leaves(ct) if hasattr(c, "dtype") and jnp.issubdtype(c.dtype, jnp.inexact)]
    if not leaves:
        return vals
    zero = jnp.sum(leaves[0]) * 0  # a full reduction: XLA cannot narrow it to a slice

    def tie(v):
        if (hasattr(v, "dtype") and v.ndim > 0 and v.dtype != jnp.bool_
                and jnp.issubdtype(v.dtype, jnp.number)):
            return v + zero.astype(v.dtype)
        return v
    return [tie(v) for v in vals]


def named_outputs(graph: OpGraph, names: Mapping[int, str] | None) -> OutputHook | None:
    """An `eval_ops` hook that attaches `checkpoint_name(names[op index])` to the floating
    results of the named ops (what a `save_only_these_names` policy keeps)."""
    if not names:
        return None

    def hook(op, vid, value):
        name = names.get(op.index)
        return checkpoint_name(value, name) if name is not None and graph.vars[vid].is_float else value
    return hook


def tie_choice(program: OpGraph, start: int, stop: int, ins: Sequence[int]) -> list[bool]:
    """Which region inputs to tie to the cotangent so every op that depends on an input is
    recomputed after the cotangent: activations first, then program inputs, smallest first,
    until each such op depends on a tied input; also every program input as large as the
    region's outputs (a batch rather than a weight)."""
    bit = {v: 1 << i for i, v in enumerate(ins)}
    dep: dict[int, int] = dict(bit)
    op_deps = []
    for op in program.ops[start:stop]:
        d = 0
        for a in op.inputs:
            d |= dep.get(a, 0)
        for o in op.outputs:
            dep[o] = d
        if d:
            op_deps.append(d)
    invars = set(program.invars)
    numeric = [i for i, v in enumerate(ins) if program.vars[v].dtype != "bool"]
    order = sorted(numeric, key=lambda i: (ins[i] in invars, program.vars[ins[i]].nbytes))
    tied = 0
    for i in order:
        if all(d & tied for d in op_deps):
            break
        if any(d & (1 << i) and not d & tied for d in op_deps):
            tied |= 1 << i
    # program inputs as large as the region's activations (a batch, not a weight): the
    # backward's own work on them (e.g. the transposed image a conv's weight gradient reads)
    # must not be hoisted to the start of the program either
    _, outs = block_io(program, start, stop)
    act = max([program.vars[v].nbytes for v in outs] or [0])
    for i in numeric:
        v = ins[i]
        if v in invars and program.vars[v].is_float and program.vars[v].nbytes >= act // 2 > 0:
            tied |= 1 << i
    return [bool(tied >> i & 1) for i in range(len(ins))]


def _release_together(cts, act_mask, use_cond: bool = True):
    """Make the activation cotangents depend on every parameter cotangent, so the parameter
    gradients (and the residuals they read) are finished before earlier blocks start, and
    pass them out through a `cond`, which XLA cannot fuse across: without it, XLA's loop
    fusion duplicates the chain of cotangent adds of residual connections into every later
    block's backward, so each block's contribution to the cotangent stays alive until the
    end of the backward pass (measured: +4 activation-sized buffers on a 6-layer MLP)."""
    idx = [i for i, (c, m) in enumerate(zip(cts, act_mask)) if m and hasattr(c, "dtype")
           and jnp.issubdtype(c.dtype, jnp.inexact) and c.size > 0]
    if not idx:
        return cts
    params = [c for c, m in zip(cts, act_mask) if not m and hasattr(c, "dtype")
              and jnp.issubdtype(c.dtype, jnp.inexact) and c.size > 0]
    if not params and not use_cond:
        return cts
    zero = sum(jnp.sum(p) for p in (params or [cts[idx[0]]])) * 0
    if not use_cond:
        return [c + zero.astype(c.dtype) if i in idx else c for i, c in enumerate(cts)]
    # the NaN branch keeps NaN/inf gradients what they were; the other one is the identity
    acts = lax.cond(jnp.isnan(zero), lambda cs: [c + zero.astype(c.dtype) for c in cs],
                    lambda cs: list(cs), [cts[i] for i in idx])
    out = list(cts)
    for i, v in zip(idx, acts):
        out[i] = v
    return out


def materialize(vals):
    """The same values, passed through a `cond` (one whose branches XLA cannot fuse across),
    so each array leaves as a buffer of its own. Without it XLA duplicates cheap elementwise
    producers (a residual `relu(x + conv(h))`) into every consumer, and the operands of the
    chain (every earlier block's conv output) stay alive instead of the one kept activation."""
    idx = [i for i, v in enumerate(vals) if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.inexact)
           and v.size > 1]
    if not idx:
        return vals
    probe = jnp.isnan(vals[idx[0]].reshape(-1)[0])
    # both branches are the identity on values (`c * 1` only keeps JAX from forwarding them)
    outs = lax.cond(probe, lambda cs: [c * 1 for c in cs], lambda cs: list(cs), [vals[i] for i in idx])
    vals = list(vals)
    for i, v in zip(idx, outs):
        vals[i] = v
    return vals


def recompute_region(fn: Callable, tie_mask: Sequence[bool], policy=None,
                     act_mask: Sequence[bool] | None = None, use_cond: bool = True) -> Callable:
    """`fn(*args)` whose backward recomputes it (saving only `policy` names) after the cotangent arrives.

    Arguments flagged in `tie_mask` (activations, not parameters) and the values the policy
    saves are tied to the cotangent before recomputation.
    """
    ckpt = jax.checkpoint(fn, policy=policy) if policy is not None else fn
    act_mask = tie_mask if act_mask is None else act_mask
    meta: dict = {}  # static residual layout, recorded while tracing fwd

    @jax.custom_vjp
    def region(*args):
        return fn(*args)

    def fwd(*args):
        if policy is None:
            return fn(*args), tuple(args)
        out, vjp_fn = jax.vjp(ckpt, *args)
        leaves, tree = jax.tree.flatten(vjp_fn)
        meta["tree"] = tree
        meta["is_param"] = [any(l is a for a, m in zip(args, tie_mask) if not m) for l in leaves]
        return out, tuple(leaves)

    def bwd(res, ct):
        if policy is None:
            args = list(res)
            tied = iter(_tie_to_cotangent([a for a, m in zip(args, tie_mask) if m], ct))
            args = [next(tied) if m else a for a, m in zip(args, tie_mask)]
            _, vjp_fn = jax.vjp(ckpt, *args)
        else:
            is_param = meta["is_param"]
            tied = iter(_tie_to_cotangent([l for l, p in zip(res, is_param) if not p], ct))
            leaves = [l if p else next(tied) for l, p in zip(res, is_param)]
            vjp_fn = jax.tree.unflatten(meta["tree"], leaves)
        cts = _release_together(vjp_fn(ct), act_mask, use_cond)
        return tuple(None if getattr(c, "dtype", None) == jax.dtypes.float0 else c for c in cts)

    region.defvjp(fwd, bwd)
    return region


Region = tuple[Callable, tuple[int, ...], tuple[int, ...]]  # fn(*ins) -> outs, input ids, output ids


def region_function(program: OpGraph, start: int, stop: int, body: Callable[[dict], None],
                    policy_names: Sequence[str] | None, recompute: bool, boundary: bool = False,
                    boundary_conds: bool = True) -> Region:
    """Ops [start, stop) as a function of their external inputs: `body(env)` fills in the
    outputs; with `recompute`, its backward recomputes it (saving `policy_names`) after
    the cotangent arrives; with `boundary`, outputs leave through `materialize`."""
    ins, outs = block_io(program, start, stop)

    def fn(*vals):
        local = dict(zip(ins, vals))
        body(local)
        return tuple(local[o] for o in outs)

    if recompute:
        invars = set(program.invars)
        act_mask = [v not in invars and program.vars[v].is_float for v in ins]
        policy = (jax.checkpoint_policies.save_only_these_names(*policy_names)
                  if policy_names is not None else None)
        fn = recompute_region(fn, tie_choice(program, start, stop, ins), policy, act_mask, boundary_conds)
    if boundary and boundary_conds:
        inner = fn
        fn = lambda *vals: tuple(materialize(list(inner(*vals))))  # noqa: E731
    return fn, ins, outs


def block_function(program: OpGraph, blk: Block, option, boundary_conds: bool = True) -> Region:
    """One block run as the schedule runs it with `option` (a BlockOption or BlockChoice:
    `kept` op indices within the block or scan body, `keep_all` for plain autodiff)."""
    tag = f"rm{next(_uid)}"
    if blk.is_scan:
        return region_function(program, blk.start, blk.stop, lambda e: _run_scan(program, blk, option, e, tag),
                               None, recompute=False)
    names = {blk.start + i: f"{tag}_{blk.start + i}" for i in option.kept}

    def body(e):
        eval_ops(program, e, range(blk.start, blk.stop), named_outputs(program, names))
    return region_function(program, blk.start, blk.stop, body, tuple(names.values()),
                           recompute=not option.keep_all, boundary=True, boundary_conds=boundary_conds)


def lower(program: OpGraph, chain: Chain, options: Mapping[int, BlockOption],
          schedule: Schedule, boundary_conds: bool = True) -> Callable:
    """A function of the program's flat inputs that runs `schedule` and returns flat outputs.

    `boundary_conds=False` leaves out the `cond`s that materialise block outputs and input
    cotangents (for planners that cannot shard through a `cond`; XLA may then keep more)."""
    def run(region: Region, env: dict) -> None:
        fn, ins, outs = region
        env.update(zip(outs, fn(*[env[v] for v in ins])))

    def run_seq(tree: Schedule, env: dict) -> None:
        if isinstance(tree, Leaf):
            run(block_function(program, chain.blocks[tree.block], options[tree.block], boundary_conds), env)
            if tree.rest is not None:
                run_seq(tree.rest, env)
            return
        start = chain.blocks[_first_block(tree.left)].start
        stop = chain.blocks[tree.at - 1].stop
        run(region_function(program, start, stop, lambda e: run_seq(tree.left, e), None, recompute=True,
                            boundary_conds=boundary_conds), env)
        run_seq(tree.right, env)

    def run_program(*flat_args):
        env = dict(zip(program.invars, flat_args))
        run_seq(schedule, env)
        return [env[v] if v in env else program.literals[v] for v in program.outvars]

    return run_program


def _first_block(tree: Schedule) -> int:
    while isinstance(tree, Split):
        tree = tree.left
    return tree.block


def _run_scan(program: OpGraph, blk: Block, opt: BlockOption, env: dict, tag: str) -> None:
    """Re-emit the scan with a body checkpointed under the option's name policy."""
    op = program.ops[blk.start]
    p = op.params
    body = op.body
    nc, ncarry = p["num_consts"], p["num_carry"]
    args = [env[a] if a in env else program.literals[a] for a in op.inputs]
    consts, init, xs = args[:nc], args[nc:nc + ncarry], args[nc + ncarry:]
    names = {k: f"{tag}_{k}" for k in opt.kept}

    def step(carry, x):
        e = dict(zip(body.invars, list(consts) + list(carry) + list(x)))
        eval_ops(body, e, on_output=named_outputs(body, names))
        outs = [e[v] if v in e else body.literals[v] for v in body.outvars]
        return outs[:ncarry], outs[ncarry:]

    if not opt.keep_all:
        step = jax.checkpoint(step, policy=jax.checkpoint_policies.save_only_these_names(*names.values()))
    carry, ys = lax.scan(step, list(init), list(xs), length=p["length"], reverse=p["reverse"],
                         unroll=p.get("unroll", 1))
    for vid, val in zip(op.outputs, list(carry) + list(ys)):
        env[vid] = val
