"""Run a pipelined loss and its gradient over token slices (TeraPipe).

Work items are (micro-batch, slice). A stage's forward of slice i runs its layers' ops
of the loss on the slice's positions (`token_eval`), with the keys and values of slices
0..i-1 of the same micro-batch as the context of every `causal_attention` call, and
returns its activations, its own keys and values (the next slices' context) and a VJP
of all that. The backward of slice i runs that VJP with the cotangents of its
activations and of its keys and values, which the later slices (run backward first)
have added up; the cotangents it gets for its context go to the earlier slices.

Micro-batches may differ in size (TeraPipe's batch split): each size has its own trace
of the loss, and its share of the loss is weighted by its size. Stages run on their
submeshes with their parameters in their planned layouts; the activations of a slice
are left to XLA's propagation from there.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopar.distributed import replicated, transfer
from autopar.pipeline.runtime import PipelineRun
from autopar.pipeline.schedule import Task, issue_order, stage_orders
from autopar.pipeline.stage import StagePrograms
from autopar.pipeline.token_eval import Slice, SizedLoss, Tok, TokenSliceError, check_sliceable, sized_loss
from autopar.pipeline.trace import StepTracer, TracedStep
from autopar.plan import TokenSlicing


class TokenStage:
    """One stage's slice programs: forward (with its VJP kept as the residuals) and backward."""

    def __init__(self, programs: StagePrograms, losses: dict[int, SizedLoss], seq_len: int):
        self.p, self.losses, self.T = programs, losses, seq_len
        st = programs.stage
        self.ops = [i for lg in st.layers for i in lg.spec.ops]
        g = next(iter(losses.values())).graph
        self.marks = sorted({g.ops[i].mark for i in self.ops if g.ops[i].mark is not None})
        self.rep = replicated(programs.mesh)
        # a stage planned with remat recomputes its whole forward per slice in the backward
        # (the slice's inputs are all it keeps): the 4 passes token_cost prices, and no more
        # memory than the per-layer schedule the planner priced
        self.remat = any(lg.remat != "none" for lg in st.layers)
        self._forward = jax.jit(self._forward_fn, static_argnums=(0, 1))
        self._backward = jax.jit(self._backward_fn, static_argnums=(0, 1))
        # per (size, slice): the VJP's structure and which of its leaves are the parameters
        # (those are passed again to the backward instead of being kept per slice in flight)
        self._vjp_layout: dict[tuple[int, Slice], tuple[Any, tuple[int, ...]]] = {}

    def float_vars(self, size: int, vs: Sequence[int]) -> list[bool]:
        g = self.losses[size].graph
        return [g.vars[v].is_float for v in vs]

    def _forward_fn(self, size: int, seq: Slice, params, batch, acts, ctx):
        loss = self.losses[size]
        g, ev, st = loss.graph, loss.evaluator, self.p.stage
        fl_in = self.float_vars(size, st.in_acts)
        fl_out = self.float_vars(size, st.out_acts)

        def f(params, float_acts, ctx):
            env: dict[int, Any] = {}
            env.update((g.invars[i], x) for i, x in zip(st.param_inputs, params))
            for i, x in zip(st.batch_inputs, batch):
                v = g.invars[i]
                k = ev.kind(v)
                env[v] = jax.lax.slice_in_dim(x, seq.offset, seq.offset + seq.length, axis=k.axis) \
                    if isinstance(k, Tok) else x
            it_f, it_o = iter(float_acts), iter(other_acts)
            env.update((v, next(it_f) if fl else next(it_o)) for v, fl in zip(st.in_acts, fl_in))
            grown = ev.run(env, self.ops, seq, dict(zip(self.marks, ctx)) if ctx else {})
            outs = [env[v] if v in env else g.literals[v] for v in st.out_acts]
            kv = tuple(grown[m] for m in self.marks)
            return (tuple(o for o, fl in zip(outs, fl_out) if fl), kv), tuple(o for o, fl in zip(outs, fl_out) if not fl)

        float_acts = tuple(a for a, fl in zip(acts, fl_in) if fl)
        other_acts = tuple(a for a, fl in zip(acts, fl_in) if not fl)
        run = jax.checkpoint(f) if self.remat else f
        (float_outs, kv), pullback, other_outs = jax.vjp(run, params, float_acts, ctx, has_aux=True)
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        index = {id(p): k for k, p in enumerate(params)}
        slots = tuple(index.get(id(x), -1) for x in leaves)
        self._vjp_layout[(size, seq)] = (treedef, slots)
        return float_outs, other_outs, kv, tuple(x for x, k in zip(leaves, slots) if k < 0)

    def _backward_fn(self, size: int, seq: Slice, params, kept, cts):
        treedef, slots = self._vjp_layout[(size, seq)]
        it = iter(kept)
        pullback = jax.tree_util.tree_unflatten(treedef, [params[k] if k >= 0 else next(it) for k in slots])
        return pullback(cts)

    def forward(self, size: int, seq: Slice, params, batch, acts, ctx):
        put = lambda x: transfer(x, self.rep)
        return self._forward(size, seq, params, tuple(map(put, batch)), tuple(map(put, acts)),
                             jax.tree_util.tree_map(put, ctx))

    def backward(self, size: int, seq: Slice, params, kept, cts):
        return self._backward(size, seq, params, kept, cts)

    # --- ahead of time ---------------------------------------------------------------
    def abstract_args(self, size: int, seq: Slice, slices_before: Sequence[int]):
        """ShapeDtypeStructs (with shardings) of the forward of one slice."""
        loss = self.losses[size]
        g, ev, st = loss.graph, loss.evaluator, self.p.stage
        sds = lambda shape, v, sh: jax.ShapeDtypeStruct(shape, g.vars[v].abstract().dtype, sharding=sh)

        def at_slice(v: int, length: int) -> tuple[int, ...]:
            k, shape = ev.kind(v), g.vars[v].shape
            if not isinstance(k, Tok):
                return shape
            return tuple(k.outer * length * k.inner if a == k.axis else n for a, n in enumerate(shape))

        params = tuple(sds(g.vars[g.invars[i]].shape, g.invars[i], self.p.param_sharding(i)) for i in st.param_inputs)
        batch = tuple(sds(g.vars[g.invars[i]].shape, g.invars[i], self.rep) for i in st.batch_inputs)
        acts = tuple(sds(at_slice(v, seq.length), v, self.rep) for v in st.in_acts)
        ctx = ()
        if slices_before:
            ctx = tuple(tuple(tuple(sds(at_slice(x, l), x, self.rep) for l in slices_before) for x in
                              ev.attention[m][0][1:3]) for m in self.marks)
        return params, batch, acts, ctx

    def lower(self, size: int, seq: Slice, slices_before: Sequence[int]):
        """The lowered forward and backward of one slice, from abstract inputs only."""
        params, batch, acts, ctx = self.abstract_args(size, seq, slices_before)
        fwd = self._forward.lower(size, seq, params, batch, acts, ctx)
        f_outs, _, kv, kept = jax.eval_shape(lambda *a: self._forward_fn(size, seq, *a), params, batch, acts, ctx)
        return fwd, self._backward.lower(size, seq, params, kept, (f_outs, kv))


def _check_slicing(sl: TokenSlicing, traced: TracedStep) -> None:
    """A (possibly loaded) token slicing against the step it is to run."""
    from autopar.attention import attention_calls
    from autopar.pipeline.token_plan import sequence_length
    from autopar.plan import PlanFileError

    T = sequence_length(attention_calls(traced.loss_jaxpr), sl.slices)
    batch = traced.micro_batch_size * traced.num_micro_batches
    problems = []
    if sl.seq_len != T:
        problems.append(f"it slices sequences of {sl.seq_len} tokens, the step's have {T}")
    if sum(sl.micro_batch_sizes) != batch:
        problems.append(f"its micro-batches {list(sl.micro_batch_sizes)} sum to {sum(sl.micro_batch_sizes)} sequences, "
                        f"the batch has {batch}")
    if len(sl.slices) != len(sl.micro_batch_sizes) or any(sum(x) != T or min(x) < 1 for x in sl.slices):
        problems.append(f"its slices {[list(x) for x in sl.slices]} are not positive lengths summing to {T} per "
                        f"micro-batch")
    if problems:
        raise PlanFileError("the plan's token slicing does not fit this step: " + "; ".join(problems) + "; re-plan")


def slice_losses(tracer: StepTracer, traced: TracedStep, seq_len: int, sizes: Sequence[int]) -> dict[int, SizedLoss]:
    """The loss for micro-batches of each of `sizes` sequences (the traced step's own size
    and one trace per other size), ready to run on token slices."""
    N = traced.micro_batch_size * traced.num_micro_batches
    reference = sized_loss(traced, seq_len)
    losses = {traced.micro_batch_size: reference}
    for b in sorted(set(sizes)):
        if b not in losses:
            if N % b:
                raise TokenSliceError(f"micro-batches of {b} sequences do not divide the batch of {N}")
            losses[b] = sized_loss(tracer.at(N // b), seq_len, reference.graph)
    return losses


def _nbytes(tree: Any, exclude: set[int]) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes") and id(x) not in exclude)


class TokenPipelineRuntime:
    """Forward and backward of the stages over (micro-batch, slice) items, in the order of
    the schedule; same interface as `PipelineRuntime`."""

    def __init__(self, programs: Sequence[StagePrograms], slicing: TokenSlicing, schedule: str,
                 tracer: StepTracer, traced: TracedStep):
        self.programs = list(programs)
        self.slicing = slicing
        T = slicing.seq_len
        _check_slicing(slicing, traced)
        losses = slice_losses(tracer, traced, T, slicing.micro_batch_sizes)
        first = slicing.slices[0]
        for loss in losses.values():
            check_sliceable(loss, Slice(first[0] if len(first) > 1 else 0, first[-1], T))
        self.losses = losses
        self.stages = [TokenStage(p, losses, T) for p in self.programs]
        self.order = issue_order(stage_orders(schedule, len(self.programs), len(slicing.slices),
                                              [len(s) for s in slicing.slices]))
        self.owner: dict[int, int] = {}
        for s, p in enumerate(self.programs):
            for i in p.stage.param_inputs:
                self.owner.setdefault(i, s)
        self.producer = {v: s for s, p in enumerate(self.programs) for v in p.stage.out_acts}
        self.consumers = [{v: [t for t in range(s + 1, len(self.programs)) if v in self.programs[t].stage.in_acts]
                           for v in p.stage.out_acts} for s, p in enumerate(self.programs)]

    def param_sharding(self, pos: int):
        return self.programs[self.owner[pos]].param_sharding(pos)

    def lowered_programs(self) -> list[dict[str, Any]]:
        """Per stage, every slice's lowered forward and backward ("forward b=2 tokens 0:4")."""
        sl = self.slicing
        out = []
        for ts in self.stages:
            progs = {}
            for b, lengths in dict.fromkeys(zip(sl.micro_batch_sizes, sl.slices)):
                for i, l in enumerate(lengths):
                    seq = Slice(int(sum(lengths[:i])), int(l), sl.seq_len)
                    progs[f"forward b={b} tokens {seq.offset}:{seq.offset + l}"], \
                        progs[f"backward b={b} tokens {seq.offset}:{seq.offset + l}"] = ts.lower(b, seq, lengths[:i])
            out.append(progs)
        return out

    def compile_stages(self, options: dict | None = None) -> Any:
        """Every stage's slice programs compiled ahead of time from abstract inputs; a
        stage's entry in `.stages` is the backward of the last slice of its largest
        micro-batch (the most context)."""
        from autopar.executable import CompiledStep

        sl = self.slicing
        m = max(range(len(sl.slices)), key=lambda k: (sl.micro_batch_sizes[k], sl.slices[k][-1]))
        key = f"backward b={sl.micro_batch_sizes[m]} tokens {sl.seq_len - sl.slices[m][-1]}:{sl.seq_len}"
        programs = [{name: low.compile(options) for name, low in progs.items()} for progs in self.lowered_programs()]
        return CompiledStep([progs[key] for progs in programs], programs)

    def run(self, inputs: Sequence[Any], diff_mask: Sequence[bool], split_mask: Sequence[bool]) -> PipelineRun:
        sl = self.slicing
        sizes, T = sl.micro_batch_sizes, sl.seq_len
        N = sum(sizes)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
        micro = {i: ([x[s:s + b] for s, b in zip(starts, sizes)] if split_mask[i] else [x] * len(sizes))
                 for i, x in enumerate(inputs) if not diff_mask[i]}
        params = [tuple(transfer(inputs[i], p.param_sharding(i)) for i in p.stage.param_inputs)
                  for p in self.programs]
        param_ids = {id(x) for ps in params for x in ps}
        grad_acc = [tuple(jnp.zeros(x.shape, x.dtype, device=x.sharding) for x in ps) for ps in params]
        S = len(self.programs)
        loss_acc = 0.0
        inbox: dict[tuple, Any] = {}
        ct_inbox: dict[tuple, list] = {}
        kv_out: dict[tuple[int, int], list] = {}        # (stage, micro-batch) -> each slice's keys/values
        kv_ct: dict[tuple[int, int, int], Any] = {}     # cotangents of a slice's keys/values, summed
        residuals: dict[tuple[int, int, int], Any] = {}
        live = [0] * S
        peak = [0] * S
        live_bytes = [0] * S
        peak_bytes = [0] * S
        for task in self.order:
            s, m, i = task.stage, task.micro_batch, task.slice
            ts, prog = self.stages[s], self.programs[s]
            st = prog.stage
            lengths = sl.slices[m]
            seq = Slice(int(sum(lengths[:i])), int(lengths[i]), T)
            weight = sizes[m] / N
            if task.kind == "F":
                batch = tuple(micro[b][m] for b in st.batch_inputs)
                acts = tuple(inbox.pop((s, m, i, v)) for v in st.in_acts)
                earlier = kv_out.get((s, m), [])
                ctx = tuple((tuple(e[n][0] for e in earlier), tuple(e[n][1] for e in earlier))
                            for n in range(len(ts.marks))) if i else ()
                f_outs, o_outs, kv, pullback = ts.forward(sizes[m], seq, params[s], batch, acts, ctx)
                kv_out.setdefault((s, m), []).append(kv)
                nbytes = _nbytes(pullback, param_ids) + _nbytes(kv, set())
                residuals[(s, m, i)] = (pullback, nbytes)
                live[s] += 1
                peak[s] = max(peak[s], live[s])
                live_bytes[s] += nbytes
                peak_bytes[s] = max(peak_bytes[s], live_bytes[s])
                fl_out = ts.float_vars(sizes[m], st.out_acts)
                f_it, o_it = iter(f_outs), iter(o_outs)
                outs = [next(f_it) if fl else next(o_it) for fl in fl_out]
                if st.is_last:
                    loss_acc = loss_acc + weight * outs[0]
                for v, x in zip(st.out_acts, outs):
                    for t in self.consumers[s].get(v, ()):
                        inbox[(t, m, i, v)] = transfer(x, self.stages[t].rep)
            else:
                pullback, nbytes = residuals.pop((s, m, i))
                live[s] -= 1
                live_bytes[s] -= nbytes
                kv = kv_out[(s, m)][i]
                fl_out = ts.float_vars(sizes[m], st.out_acts)
                if st.is_last:
                    # made on the stage's devices: with several processes a default-device
                    # scalar would be a cross-process send no other process matches
                    dtype = ts.losses[sizes[m]].graph.vars[st.out_acts[0]].abstract().dtype
                    ct_outs = (transfer(np.asarray(weight, dtype), ts.rep),)
                else:
                    ct_outs = tuple(_sum(ct_inbox.pop((s, m, i, v))) for v, fl in zip(st.out_acts, fl_out) if fl)
                ct_kv = kv_ct.pop((s, m, i), None)
                if ct_kv is None:
                    ct_kv = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), kv)
                g_params, g_acts, g_ctx = ts.backward(sizes[m], seq, params[s], pullback, (ct_outs, ct_kv))
                grad_acc[s] = _accumulate(grad_acc[s], g_params)
                fl_in = ts.float_vars(sizes[m], st.in_acts)
                for v, g in zip([v for v, fl in zip(st.in_acts, fl_in) if fl], g_acts):
                    src = self.producer[v]
                    ct_inbox.setdefault((src, m, i, v), []).append(transfer(g, self.stages[src].rep))
                for j in range(i if g_ctx else 0):
                    piece = tuple((g_ctx[n][0][j], g_ctx[n][1][j]) for n in range(len(ts.marks)))
                    prev = kv_ct.get((s, m, j))
                    kv_ct[(s, m, j)] = piece if prev is None else _accumulate(prev, piece)
                if i == 0:
                    kv_out.pop((s, m), None)
        grads: dict[int, Any] = {}
        for prog, acc in zip(self.programs, grad_acc):
            for k, g in zip(prog.stage.param_inputs, acc):
                g = transfer(g, self.param_sharding(k))
                grads[k] = g if k not in grads else grads[k] + g
        for k, d in enumerate(diff_mask):
            if d and k not in grads:
                grads[k] = jnp.zeros_like(inputs[k])
        return PipelineRun(loss_acc, grads, peak, list(self.order), peak_bytes)


@jax.jit
def _accumulate(acc: Any, add: Any) -> Any:
    """acc + add leaf by leaf, in acc's dtypes, as one program. With several processes a
    sequence of eager adds on a stage's arrays hung (measured: both processes blocked in
    the gradient accumulation); the jitted sum does not."""
    return jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), acc, add)


def _sum(values: list) -> Any:
    out = values[0]
    for v in values[1:]:
        out = _accumulate(out, v)
    return out
