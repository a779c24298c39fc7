"""Run a loss graph traced on whole sequences on one token slice (TeraPipe).

The graph was traced with sequences of T tokens. To run positions [offset, offset + l)
of it, every value is one of:

- free: independent of the sequence's content (parameters, constants, position tables,
  iotas). Computed at its traced shape; where it meets a per-position value along that
  value's position axis (a position embedding added to the tokens' embeddings, a dropout
  mask drawn for the whole sequence) the slice's positions are cut out of it, so the
  slice sees what the whole sequence would have seen.
- `Tok(axis)`: one entry per position along `axis` (possibly merged with other dims by a
  reshape: `inner` elements per position, `outer` blocks of positions). Computed at the
  slice's shape: ops whose params carry shapes (broadcast_in_dim, reshape, slice, gather)
  get the slice's sizes.
- `TOKSUM`: a sum over positions of per-position values (the loss's mean: its divisor
  is the whole sequence's count, so a slice's value is its share of the loss). Only
  linear ops may follow; a term that does not depend on the tokens (weight decay) is
  added by the first slice only.

`autopar.causal_attention` calls (marked in the graph) are the one place positions meet:
each runs on the slice's queries with the keys and values of the earlier slices as
context, and hands the grown context on. Any other op that mixes positions (a mean over
the sequence before the head, a cumulative sum, an attention written by hand, a shift)
is refused with `TokenSliceError`, before anything runs: a silently wrong gradient is
worse than no token pipeline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from autopar.attention import ATTENTION_CALL, autopar_causal_attention
from rockmate.graph import Op, OpGraph, graph_from_jaxpr

if TYPE_CHECKING:
    from autopar.pipeline.trace import TracedStep


class TokenSliceError(ValueError):
    """The loss cannot be computed slice by slice along its sequence."""


@dataclass(frozen=True)
class Tok:
    """Per-position along `axis`, whose size is outer * positions * inner."""

    axis: int
    inner: int = 1
    outer: int = 1


class _TokSum:
    def __repr__(self) -> str:
        return "TOKSUM"


TOKSUM = _TokSum()
FREE = None


@dataclass(frozen=True)
class Slice:
    """Positions [offset, offset + length) of sequences of `seq_len` tokens."""

    offset: int
    length: int
    seq_len: int


SHAPE_SENSITIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "rev", "argsort", "top_k",
                   "scan", "while", "cond", "conv_general_dilated", "reduce_window", "reduce_window_sum",
                   "select_and_scatter_add", "dynamic_slice", "dynamic_update_slice", "scatter", "scatter-add",
                   "scatter_add", "fft", "custom_linear_solve"}
REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax",
              "argmin", "reduce_precision_sum"}
LINEAR_ON_SUMS = {"mul", "div", "neg", "convert_element_type", "reduce_sum", "broadcast_in_dim", "reshape",
                  "squeeze", "transpose", "dot_general", "add", "sub", "copy", "copy_p"}


def _where(op: Op) -> str:
    return f"{op.name}" + (f" at {op.source}" if op.source else "")


def _sized(size: int, kind: Tok, seq: Slice) -> int:
    """An axis's size at the slice."""
    return kind.outer * seq.length * kind.inner if size == kind.outer * seq.seq_len * kind.inner else size


def _cut(x: Any, axis: int, kind: Tok, seq: Slice) -> Any:
    """The slice's positions of a free value along `axis` (size 1: broadcast, kept)."""
    n = x.shape[axis]
    if n == 1:
        return x
    if n != kind.outer * seq.seq_len * kind.inner:
        raise TokenSliceError(f"a value of shape {x.shape} meets per-position values along axis {axis} with "
                              f"{kind.outer * seq.seq_len * kind.inner} entries")
    if seq.offset == 0 and seq.length == seq.seq_len:
        return x
    shape = x.shape
    y = x.reshape(*shape[:axis], kind.outer, seq.seq_len, kind.inner, *shape[axis + 1:])
    y = lax.slice_in_dim(y, seq.offset, seq.offset + seq.length, axis=axis + 1)
    return y.reshape(*shape[:axis], kind.outer * seq.length * kind.inner, *shape[axis + 1:])


def _reshape_kind(kind: Tok, in_shape: Sequence[int], out_shape: Sequence[int], T: int) -> Tok | None:
    """Where the positions go through a row-major reshape (None: split over several axes)."""
    after = math.prod(in_shape[kind.axis + 1:]) * kind.inner      # elements per position
    for j in range(len(out_shape)):
        below = math.prod(out_shape[j + 1:])
        if after % below == 0 and after * T <= below * out_shape[j] and (below * out_shape[j]) % (after * T) == 0:
            inner = after // below
            return Tok(j, inner, out_shape[j] // (inner * T))
    return None


class SliceEvaluator:
    """Evaluates ops of one loss graph on token slices; records each var's kind."""

    def __init__(self, graph: OpGraph, seq_len: int, token_inputs: dict[int, Tok]):
        self.graph, self.T = graph, seq_len
        self.kinds: dict[int, Any] = {v: token_inputs.get(v, FREE) for v in graph.invars}
        self._bodies: dict[int, OpGraph] = {}
        # attention calls: mark -> (q, k, v, scale) input vars and the output var
        self.attention: dict[int, tuple[tuple[int, ...], int]] = {
            m: (ins, outs[0]) for m, (ins, outs) in graph.call_io.items()}

    def kind(self, v: int) -> Any:
        return self.kinds.get(v, FREE) if v not in self.graph.literals else FREE

    # --- evaluation ----------------------------------------------------------------------
    def run(self, env: dict[int, Any], ops: Iterable[int], seq: Slice,
            context: dict[int, tuple[Sequence[Any], Sequence[Any]]]) -> dict[int, tuple[Any, Any]]:
        """Evaluate `ops` into `env` (var -> value at the slice's shapes); `context`: per
        attention call (mark), the keys and the values of each earlier slice. Returns each
        attention call's keys and values of this slice (the next slices' context)."""
        g = self.graph
        grown: dict[int, tuple[Any, Any]] = {}
        for i in ops:
            op = g.ops[i]
            if op.mark is not None and op.mark in self.attention:
                if op.mark not in grown and self.attention[op.mark][1] not in env:
                    grown[op.mark] = self._attention(op, env, seq, context.get(op.mark))
                continue
            ins = [env[v] if v in env else g.literals[v] for v in op.inputs]
            outs = self._apply(op, [self.kind(v) for v in op.inputs], ins, seq)
            for v, (k, x) in zip(op.outputs, outs):
                self.kinds[v] = k
                env[v] = x
        return grown

    def _attention(self, op: Op, env: dict[int, Any], seq: Slice, ctx):
        ins, out = self.attention[op.mark]
        if len(ins) != 4:
            raise TokenSliceError(f"causal_attention call {op.mark} has {len(ins)} inputs, expected q, k, v, scale")
        for v, name in zip(ins[:3], "qkv"):
            if self.kind(v) != Tok(1):
                raise TokenSliceError(
                    f"causal_attention's {name} ({_where(op)}) is {self._describe(v)}: token slicing needs q, k "
                    f"and v computed position by position from the tokens, shaped [batch, seq, heads, head_dim]")
        q, k, v = (env[x] for x in ins[:3])
        scale = env[ins[3]] if ins[3] in env else self.graph.literals[ins[3]]
        ks, vs = (k, v) if not ctx else (jnp.concatenate([*ctx[0], k], axis=1), jnp.concatenate([*ctx[1], v], axis=1))
        env[out] = autopar_causal_attention(q, ks, vs, jnp.asarray(scale))
        self.kinds[out] = Tok(1)
        return k, v

    def _describe(self, v: int) -> str:
        k = self.kind(v)
        return "independent of the tokens" if k is FREE else "a sum over positions" if k is TOKSUM else f"{k}"

    def _apply(self, op: Op, kinds: list, ins: list, seq: Slice) -> list[tuple[Any, Any]]:
        g, T = self.graph, self.T
        params = dict(op.params)
        if all(k is FREE for k in kinds):
            return list(zip([FREE] * len(op.outputs), _bind(op, ins, params)))
        if any(k is TOKSUM for k in kinds):
            return self._on_sums(op, kinds, ins, seq)
        name = op.name
        full_in = [g.vars[v].shape for v in op.inputs]
        full_out = [g.vars[v].shape for v in op.outputs]
        toks = [k for k in kinds if isinstance(k, Tok)]
        if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
            return self._inline(op, kinds, ins, seq)
        if name in SHAPE_SENSITIVE:
            raise TokenSliceError(self._mixes(op, f"{name} over per-position values"))
        if name == "broadcast_in_dim":
            k = kinds[0]
            out_kind = replace(k, axis=params["broadcast_dimensions"][k.axis])
            params["shape"] = tuple(_sized(n, out_kind, seq) if a == out_kind.axis else n
                                    for a, n in enumerate(params["shape"]))
            return [(out_kind, _bind(op, ins, params)[0])]
        if name == "reshape":
            k = kinds[0]
            out_kind = _reshape_kind(k, full_in[0], full_out[0], T)
            if out_kind is None:
                raise TokenSliceError(self._mixes(op, f"reshape {full_in[0]} -> {full_out[0]} splits the positions"))
            sizes = tuple(_sized(n, out_kind, seq) if a == out_kind.axis else n for a, n in enumerate(full_out[0]))
            params["new_sizes"] = sizes
            return [(out_kind, _bind(op, ins[:1], params)[0])]
        if name == "transpose":
            k = kinds[0]
            return [(replace(k, axis=list(params["permutation"]).index(k.axis)), _bind(op, ins, params)[0])]
        if name == "squeeze":
            k = kinds[0]
            return [(replace(k, axis=k.axis - sum(d < k.axis for d in params["dimensions"])),
                     _bind(op, ins, params)[0])]
        if name in REDUCTIONS:
            k = kinds[0]
            axes = tuple(params.get("axes", ()))
            if k.axis in axes:
                if name != "reduce_sum":
                    raise TokenSliceError(self._mixes(op, f"{name} over the positions"))
                return [(TOKSUM, _bind(op, ins, params)[0])]
            return [(replace(k, axis=k.axis - sum(a < k.axis for a in axes)), _bind(op, ins, params)[0])]
        if name == "dot_general":
            return self._dot(op, kinds, ins, seq, params)
        if name == "gather":
            return self._gather(op, kinds, ins, seq, params, full_in)
        if name in ("slice",):
            k = kinds[0]
            a = k.axis
            if params["start_indices"][a] != 0 or params["limit_indices"][a] != full_in[0][a] or \
                    (params.get("strides") and params["strides"][a] != 1):
                raise TokenSliceError(self._mixes(op, "a slice along the positions (a shift)"))
            params["limit_indices"] = tuple(_sized(n, k, seq) if d == a else n
                                            for d, n in enumerate(params["limit_indices"]))
            return [(k, _bind(op, ins, params)[0])]
        if name == "pad":
            k = kinds[0]
            lo, hi, interior = params["padding_config"][k.axis]
            if (lo, hi, interior) != (0, 0, 0):
                raise TokenSliceError(self._mixes(op, "padding along the positions (a shift)"))
            return [(k, _bind(op, [ins[0], ins[1]], params)[0])]
        if name in ("concatenate", "split"):
            axis = params["dimension"] if name == "concatenate" else params["axis"]
            k = toks[0]
            if k.axis == axis or any(t != k for t in toks):
                raise TokenSliceError(self._mixes(op, f"{name} along the positions"))
            ins = [_cut(x, k.axis, k, seq) if kk is FREE else x for x, kk in zip(ins, kinds)]
            return [(k, y) for y in _bind(op, ins, params)]
        # elementwise: every operand broadcasts to the output; the per-position ones have all its positions
        out_shape = full_out[0] if len(full_out) else ()
        fits = lambda s: len(s) == 0 or (len(s) == len(out_shape) and all(a in (1, b) for a, b in zip(s, out_shape)))
        if (len(set(full_out)) == 1 and len(set(toks)) == 1 and all(fits(s) for s in full_in)
                and all(full_in[i][k.axis] == out_shape[k.axis] for i, k in enumerate(kinds) if isinstance(k, Tok))):
            k = toks[0]
            ins = [_cut(x, k.axis, k, seq) if kk is FREE and getattr(x, "ndim", 0) else x
                   for x, kk in zip(ins, kinds)]
            return [(k, y) for y in _bind(op, ins, params)]
        raise TokenSliceError(
            f"token slicing does not know how {_where(op)} treats the sequence axis (inputs "
            f"{[self._kind_str(k) for k in kinds]}, shapes {full_in} -> {full_out}); use token_slices=1 for this "
            f"model, or compute this op outside the loss")

    def _kind_str(self, k: Any) -> str:
        return "free" if k is FREE else "sum" if k is TOKSUM else f"positions on axis {k.axis}"

    def _mixes(self, op: Op, what: str) -> str:
        return (f"the loss mixes positions outside autopar.causal_attention: {what} ({_where(op)}). A token "
                f"pipeline computes each slice of the sequence on its own (earlier slices are seen only through "
                f"causal_attention's keys and values), so this loss cannot be cut into token slices; use "
                f"token_slices=1, or make the op act position by position")

    def _dot(self, op: Op, kinds, ins, seq: Slice, params) -> list:
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        lhs_nd, rhs_nd = self.graph.vars[op.inputs[0]].ndim, self.graph.vars[op.inputs[1]].ndim
        lfree = [d for d in range(lhs_nd) if d not in lc and d not in lb]
        rfree = [d for d in range(rhs_nd) if d not in rc and d not in rb]
        outs = []
        for side, (k, contract, batch, free, offset) in enumerate(
                ((kinds[0], lc, lb, lfree, len(lb)), (kinds[1], rc, rb, rfree, len(lb) + len(lfree)))):
            if not isinstance(k, Tok):
                continue
            if k.axis in contract:
                raise TokenSliceError(self._mixes(op, "a matmul contracting the positions"))
            outs.append(replace(k, axis=list(batch).index(k.axis)) if k.axis in batch
                        else replace(k, axis=offset + free.index(k.axis)))
        if len(set(outs)) != 1:
            raise TokenSliceError(self._mixes(op, "a matmul over pairs of positions (an attention written by hand? "
                                                  "use autopar.causal_attention)"))
        out = outs[0]
        if out.axis < len(lb):     # batched over positions: cut a free operand's matching batch dim
            ins = list(ins)
            for side, (k, batch) in enumerate(((kinds[0], lb), (kinds[1], rb))):
                if k is FREE:
                    ins[side] = _cut(ins[side], batch[out.axis], out, seq)
        return [(out, _bind(op, ins, params)[0])]

    def _gather(self, op: Op, kinds, ins, seq: Slice, params, full_in) -> list:
        dn = params["dimension_numbers"]
        k_op, k_idx = kinds
        op_nd = len(full_in[0])
        if isinstance(k_op, Tok) and k_idx is FREE:
            # the positions pass through whole as an offset dim (x[..., i] of per-position values)
            a = k_op.axis
            if a in dn.start_index_map or a in dn.collapsed_slice_dims or params["slice_sizes"][a] != full_in[0][a]:
                raise TokenSliceError(self._mixes(op, "a gather that indexes the positions"))
            kept = [d for d in range(op_nd) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
            params["slice_sizes"] = tuple(_sized(n, k_op, seq) if d == a else n
                                          for d, n in enumerate(params["slice_sizes"]))
            return [(replace(k_op, axis=dn.offset_dims[kept.index(a)]), _bind(op, ins, params)[0])]
        if not isinstance(k_idx, Tok):
            raise TokenSliceError(self._mixes(op, "a gather that indexes the positions"))
        if isinstance(k_op, Tok):       # take_along_axis: positions are batching dims of both
            pos = list(dn.start_indices_batching_dims)
            if k_idx.axis not in pos or dn.operand_batching_dims[pos.index(k_idx.axis)] != k_op.axis:
                raise TokenSliceError(self._mixes(op, "a gather that indexes the positions"))
        idx_shape = self.graph.vars[op.inputs[1]].shape
        idx_nd = len(idx_shape)
        batch_dims = list(range(idx_nd - 1)) if idx_nd and idx_shape[-1] == len(dn.start_index_map) \
            else list(range(idx_nd))
        out_nd = self.graph.vars[op.outputs[0]].ndim
        out_batch = [d for d in range(out_nd) if d not in dn.offset_dims]
        return [(replace(k_idx, axis=out_batch[batch_dims.index(k_idx.axis)]), _bind(op, ins, params)[0])]

    def _inline(self, op: Op, kinds, ins, seq: Slice) -> list:
        """A custom_jvp/custom_vjp call with per-position inputs: its primal body, sliced
        (JAX then differentiates the body instead of the custom rule)."""
        if op.index not in self._bodies:
            key = "call_jaxpr" if "call_jaxpr" in op.params else "fun_jaxpr"
            self._bodies[op.index] = graph_from_jaxpr(op.params[key])
        body = self._bodies[op.index]
        n = len(body.invars)
        sub = SliceEvaluator(body, self.T, {v: k for v, k in zip(body.invars, kinds[-n:]) if isinstance(k, Tok)})
        env = dict(zip(body.invars, ins[-n:]))
        sub.run(env, range(len(body.ops)), seq, {})
        return [(sub.kind(v), env[v] if v in env else body.literals[v]) for v in body.outvars]

    def _on_sums(self, op: Op, kinds, ins, seq: Slice) -> list:
        """Ops after the loss's sum over positions: only linear ones (each slice adds its share)."""
        name = op.name
        if any(isinstance(k, Tok) for k in kinds) or name not in LINEAR_ON_SUMS or \
                (name in ("mul", "dot_general") and sum(k is TOKSUM for k in kinds) > 1) or \
                (name == "div" and kinds[1] is TOKSUM):
            raise TokenSliceError(
                f"the loss is not a sum of per-position terms: {_where(op)} combines a sum over the sequence's "
                f"positions non-linearly (e.g. a mean over the sequence before the head, or a ratio of sums); a "
                f"token pipeline adds up the slices' shares of the loss, which is exact only for a loss linear in "
                f"per-position terms (a mean over tokens plus terms that do not depend on them)")
        if name in ("add", "sub"):
            first = 1.0 if seq.offset == 0 else 0.0      # a token-free term: counted by the first slice
            ins = [x if k is TOKSUM else x * jnp.asarray(first, jnp.result_type(x)) for x, k in zip(ins, kinds)]
        return [(TOKSUM, y) for y in _bind(op, ins, dict(op.params))]


def _bind(op: Op, ins: Sequence[Any], params: dict) -> list:
    out = op.primitive.bind(*ins, **op.primitive.get_bind_params(params))
    return list(out) if op.primitive.multiple_results else [out]


@dataclass
class SizedLoss:
    """The loss traced for micro-batches of one size, ready to run on slices."""

    size: int
    graph: OpGraph
    evaluator: SliceEvaluator


def sized_loss(traced: TracedStep, seq_len: int, reference: OpGraph | None = None) -> SizedLoss:
    """The slice evaluator of `traced`'s micro-batch loss; checked to have the ops of
    `reference` (the planned trace), so that the plan's layer cuts apply to it."""
    graph = graph_from_jaxpr(traced.loss_jaxpr, keep_custom_rules=True, mark_calls=ATTENTION_CALL)
    if reference is not None and [o.name for o in graph.ops] != [o.name for o in reference.ops]:
        raise TokenSliceError(f"the loss traces to different ops on micro-batches of {traced.micro_batch_size} "
                              f"sequences than on the planned ones; use micro-batches of one size")
    tokens = {v: Tok(1) for v, split in zip(graph.invars, traced.split_mask)
              if split and graph.vars[v].ndim >= 2 and graph.vars[v].shape[1] == seq_len}
    if not tokens:
        raise TokenSliceError(f"no batch input of the loss has the sequence ({seq_len} tokens) as its second "
                              f"dimension; token slicing cuts batch inputs shaped [batch, seq, ...]")
    return SizedLoss(traced.micro_batch_size, graph, SliceEvaluator(graph, seq_len, tokens))


def check_sliceable(loss: SizedLoss, seq: Slice) -> None:
    """Run the whole loss abstractly on one slice: records every value's kind and raises
    TokenSliceError where the loss cannot be sliced, before anything runs."""
    g, ev = loss.graph, loss.evaluator

    def run(*ins):
        env = dict(zip(g.invars, ins))
        for v, x in list(env.items()):
            k = ev.kind(v)
            if isinstance(k, Tok):
                env[v] = jax.lax.slice_in_dim(x, seq.offset, seq.offset + seq.length, axis=k.axis)
        ctx = {}
        if seq.offset:
            for m, (ins_, _) in ev.attention.items():
                q = g.vars[ins_[0]]
                shape = (q.shape[0], seq.offset, *q.shape[2:])
                ctx[m] = ([jnp.zeros(shape, q.abstract().dtype)], [jnp.zeros(shape, q.abstract().dtype)])
        ev.run(env, range(len(g.ops)), seq, ctx)
        return [env[v] if v in env else g.literals[v] for v in g.outvars]

    jax.eval_shape(run, *[g.vars[v].abstract() for v in g.invars])
    if ev.kind(g.outvars[0]) is not TOKSUM:
        raise TokenSliceError("the loss is not a sum over the sequence's positions (a mean over tokens); token "
                              "slicing adds up the slices' shares of such a loss")
