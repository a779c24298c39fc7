"""A planned pipeline, runnable: the step's pre-gradient part, the pipelined loss and
gradient (`runtime`), and each stage's optimizer update on the parameters it owns, in
their planned layouts."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autopar.executable import CompiledStep, LoweredStep
from autopar.distributed import is_multi_process, replicated, transfer
from autopar.lower import build_mesh
from autopar.pipeline.runtime import PipelineRun, PipelineRuntime
from autopar.pipeline.schedule import issue_order, stage_orders
from autopar.pipeline.stage import StagePrograms
from autopar.pipeline.trace import TracedStep
from autopar.pipeline.update_split import StepSplit, SubProgram, split_step
from autopar.plan import Plan
from rockmate.graph import OpGraph
from rockmate.graph.evaluate import eval_ops


def partner_layouts(graph: OpGraph, prog: SubProgram, known: dict[int, NamedSharding]) -> dict[int, NamedSharding]:
    """Layouts for the vars of an update program: values combined elementwise with a
    parameter or gradient of the same shape (optimizer moments, new parameters) take its
    layout; the rest stay replicated (step counts, scalars)."""
    parent: dict[int, int] = {}

    def find(v: int) -> int:
        while parent.get(v, v) != v:
            v = parent[v]
        return v

    for i in prog.ops:
        op = graph.ops[i]
        vs = [v for v in (*op.inputs, *op.outputs) if v not in graph.literals]
        for a in vs:
            for b in vs:
                if a < b and graph.vars[a].shape == graph.vars[b].shape and graph.vars[a].ndim:
                    ra, rb = find(a), find(b)
                    if ra != rb:
                        parent[rb] = ra
    by_root: dict[int, NamedSharding] = {}
    for v, sh in known.items():
        by_root.setdefault(find(v), sh)
    return {v: by_root[find(v)] for v in {*prog.inputs, *prog.outputs} if find(v) in by_root}


class _SubProgramRun:
    """A sub-program of the step graph, jitted on one mesh with planned input layouts."""

    def __init__(self, graph: OpGraph, prog: SubProgram, mesh, layouts: dict[int, NamedSharding],
                 compiler_options: dict | None = None):
        self.graph, self.prog, self.mesh = graph, prog, mesh
        rep = NamedSharding(mesh, PartitionSpec())
        self.in_shardings = tuple(layouts.get(v, rep) for v in prog.inputs)
        out_shardings = tuple(layouts.get(v, rep) for v in prog.outputs)

        def fn(*ins):
            env = dict(zip(prog.inputs, ins))
            eval_ops(graph, env, prog.ops)
            return tuple(env[v] for v in prog.outputs)

        self.jitted = jax.jit(fn, in_shardings=self.in_shardings, out_shardings=out_shardings)
        self.compiler_options = compiler_options
        self.compiled = None

    def __call__(self, read) -> tuple:
        ins = [transfer(read(v), sh) for v, sh in zip(self.prog.inputs, self.in_shardings)]
        if self.compiled is None:
            self.compiled = self.jitted.lower(*ins).compile(self.compiler_options)
        return self.compiled(*ins)


class PipeshardExecutable:
    """A planned, runnable pipeline for one input signature."""

    def __init__(self, plan: Plan, traced: TracedStep, programs: Sequence[StagePrograms], devices: Sequence[Any],
                 compiler_options: dict | None = None, tracer: Any = None):
        self.plan, self.traced, self.programs = plan, traced, list(programs)
        B = traced.num_micro_batches
        S = len(self.programs)
        slicing = plan.pipeline.token_slices if plan.pipeline is not None else None
        if slicing is not None:
            from autopar.pipeline.token_runtime import TokenPipelineRuntime

            self.runtime = TokenPipelineRuntime(self.programs, slicing, plan.schedule, tracer, traced)
        else:
            self.runtime = PipelineRuntime(self.programs, issue_order(stage_orders(plan.schedule, S, B)), B)
        step, g = traced.step, traced.step.ops[traced.grad_op]
        owner = self.runtime.owner
        diff = traced.diff_mask
        grad_in_stage = [owner.get(k, 0) if d else None for k, d in enumerate(diff)]
        diff_pos = [k for k, d in enumerate(diff) if d]
        grad_out_stage = [S - 1] + [owner.get(k, 0) for k in diff_pos]
        self.split: StepSplit = split_step(step, traced.grad_op, grad_in_stage, grad_out_stage, S)
        self.diff_pos = diff_pos
        used = sorted({d for p in self.programs for d in p.mesh.devices.flat}, key=lambda d: d.id)
        self.home = build_mesh(used, (len(used), 1))
        self.everywhere = replicated(self.home)
        self.pre = _SubProgramRun(step, self.split.pre, self.home, {}, compiler_options) if self.split.pre.ops else None
        # a parameter and its gradient live in the owner stage's layout; its optimizer state follows
        known: dict[int, NamedSharding] = {}
        for k, v in zip(diff_pos, g.outputs[1:]):
            known[v] = self.runtime.param_sharding(k)
        for k, v in enumerate(g.inputs):
            if diff[k] and v not in step.literals:
                known.setdefault(v, self.runtime.param_sharding(k))
        if self.split.updates is not None:
            self.updates = [_SubProgramRun(step, u, p.mesh, {v: sh for v, sh in partner_layouts(step, u, known).items()
                                                            if sh.mesh == p.mesh}, compiler_options)
                            for u, p in zip(self.split.updates, self.programs)]
            self.update_all = None
        else:   # one op mixes stages (e.g. a global norm clip): one program on all pipeline devices
            self.updates = None
            self.update_all = _SubProgramRun(step, self.split.update_all, self.home, {}, compiler_options)
        self.last_run: PipelineRun | None = None

    def __call__(self, *args):
        step = self.traced.step
        leaves, tree = jax.tree_util.tree_flatten((tuple(args), {}))
        if tree != step.in_tree:
            raise ValueError("the arguments' pytree structure differs from the one this pipeline was planned for; "
                             "plan again for the new structure")
        for k, (v, x) in enumerate(zip(step.invars, leaves)):
            if tuple(np.shape(x)) != step.vars[v].shape:
                raise ValueError(f"argument leaf {k} has shape {tuple(np.shape(x))} but this pipeline was planned "
                                 f"for {step.vars[v].shape}; plan again for the new shapes")
        env: dict[int, Any] = dict(zip(step.invars, leaves))
        read = lambda v: env[v] if v in env else step.literals[v]
        if self.pre is not None:
            env.update(zip(self.pre.prog.outputs, self.pre(read)))
        g = step.ops[self.traced.grad_op]
        run = self.runtime.run([read(v) for v in g.inputs], self.traced.diff_mask, self.traced.split_mask)
        self.last_run = run
        env[g.outputs[0]] = run.loss
        for v, k in zip(g.outputs[1:], self.diff_pos):
            env[v] = run.grads[k]
        for prog in self.updates if self.updates is not None else [self.update_all]:
            if prog.prog.ops:
                env.update(zip(prog.prog.outputs, prog(read)))
        out = [read(v) for v in step.outvars]
        if is_multi_process():   # the loss and other scalars readable in every process
            out = [transfer(x, self.everywhere) if isinstance(x, jax.Array) and x.ndim == 0 else x for x in out]
        return jax.tree_util.tree_unflatten(step.out_tree, out)

    # --- compiled programs ----------------------------------------------------------
    def abstract_stage_args(self, s: int) -> tuple[tuple, tuple]:
        """Abstract (ShapeDtypeStruct with sharding) arguments of stage s's forward and backward."""
        p = self.programs[s]
        (fp, fb, fa, fl), (_, res, _), (bp, br, bc, bg), _ = p.shardings()
        st = p.stage
        loss = self.traced.loss
        sds = lambda spec, sh: jax.ShapeDtypeStruct(spec.shape, spec.abstract().dtype, sharding=sh)
        params = tuple(sds(loss.vars[loss.invars[i]], sh) for i, sh in zip(st.param_inputs, fp))
        batch = tuple(sds(loss.vars[loss.invars[i]], sh) for i, sh in zip(st.batch_inputs, fb))
        acts = tuple(sds(loss.vars[v], sh) for v, sh in zip(st.in_acts, fa))
        lacc = sds(loss.vars[loss.outvars[0]], fl) if st.is_last else ()
        residuals = _residual_args(p, res)
        cts = tuple(sds(loss.vars[v], sh) for v, sh in zip(p.float_out_acts, bc))
        return (params, batch, acts, lacc), (params, residuals, cts, params)

    def compile_stages(self) -> CompiledStep:
        """Compile every stage's forward and backward ahead of time from abstract inputs
        (no data, no step run): what `lower(...).compile()` returns. With token slices:
        every slice's programs (`TokenPipelineRuntime.compile_stages`)."""
        if hasattr(self.runtime, "compile_stages"):
            return self.runtime.compile_stages(self.programs[0].compiler_options)
        for s, p in enumerate(self.programs):
            f_args, b_args = self.abstract_stage_args(s)
            fwd, bwd = p.programs()
            if p.forward_compiled is None:
                p.forward_compiled = fwd.lower(*f_args).compile(p.compiler_options)
            if p.backward_compiled is None:
                p.backward_compiled = bwd.lower(*b_args).compile(p.compiler_options)
        return CompiledStep([p.backward_compiled for p in self.programs],
                            [{"forward": p.forward_compiled, "backward": p.backward_compiled} for p in self.programs])

    def lower(self, *args, **kwargs) -> LoweredStep:
        if hasattr(self.runtime, "compile_stages"):
            return LoweredStep([], compile_fn=self.compile_stages,
                               text="\n".join(f"// stage {s} {name}\n{low.as_text()}"
                                              for s, progs in enumerate(self.runtime.lowered_programs())
                                              for name, low in progs.items()))
        return LoweredStep([], compile_fn=self.compile_stages,
                           text="\n".join(f"// stage {s} {name}\n{fn.lower(*a).as_text()}"
                                          for s, p in enumerate(self.programs)
                                          for name, fn, a in zip(("forward", "backward"), p.programs(),
                                                                 self.abstract_stage_args(s))))


def _residual_args(p: StagePrograms, shardings: Sequence[NamedSharding]) -> tuple:
    specs = [lg.graph.vars[r] for lg in p.stage.layers for r in lg.residuals]
    return tuple(jax.ShapeDtypeStruct(t.shape, t.abstract().dtype, sharding=sh) for t, sh in zip(specs, shardings))
