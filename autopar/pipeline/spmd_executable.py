"""The SPMD pipeline as one jitted program: the step traced with its loss's layer scan
replaced by `spmd.pipelined_loss`, stacked weights (and their optimizer state) split over
the stage axis, the batch over the data axis."""
from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from autopar.distributed import is_multi_process, transfer
from autopar.executable import LoweredStep
from autopar.lower import build_mesh
from autopar.pipeline.grad import transform_losses
from autopar.pipeline.spmd import DATA_AXIS, STAGE_AXIS, find_layer_scan, local_body, pipelined_loss
from autopar.pipeline.trace import StepTracer
from autopar.plan import Plan
from autopar.single_stage import flat_indices


class SpmdPipelineExecutable:
    """One program runs every stage; `stages` is one entry, the whole (S, D) mesh."""

    def __init__(self, plan: Plan, tracer: StepTracer, devices: Sequence[Any], donate_argnums: Sequence[int] = ()):
        sp = plan.spmd_pipeline
        self.plan = plan
        self.mesh = build_mesh(list(devices)[:sp.num_stages * sp.data_parallel], (sp.num_stages, sp.data_parallel))
        scan = find_layer_scan(tracer.call.loss_jaxpr, tracer.call.num_consts)
        body = local_body(tracer.at(sp.num_micro_batches * sp.data_parallel).loss_jaxpr, tracer.call.num_consts, scan)
        M, mesh, fun = sp.num_micro_batches, self.mesh, tracer.fun
        leaves, self._tree = jax.tree_util.tree_flatten(tracer.args)
        self.in_shardings = tuple(self._sharding(k, leaf) for k, leaf in enumerate(leaves))
        stacked_shapes = {tuple(leaves[k].shape) for k in sp.stacked_inputs}
        self._out_tree = None

        def run(*flat):
            args = jax.tree_util.tree_unflatten(self._tree, flat)
            with transform_losses(lambda f, a: pipelined_loss(f, a, mesh, M, body)):
                out = fun(*args)
            outs, self._out_tree = jax.tree_util.tree_flatten(out)
            # what comes back shaped like a stacked weight stays split over the stages
            return [jax.lax.with_sharding_constraint(
                o, NamedSharding(mesh, P(STAGE_AXIS) if tuple(o.shape) in stacked_shapes else P())) for o in outs]

        self.jitted = jax.jit(run, in_shardings=self.in_shardings,
                              donate_argnums=flat_indices(tracer.args, donate_argnums))

    def _sharding(self, k: int, leaf: Any) -> NamedSharding:
        sp = self.plan.spmd_pipeline
        if k in sp.stacked_inputs:
            return NamedSharding(self.mesh, P(STAGE_AXIS))
        if k in sp.batch_inputs:
            return NamedSharding(self.mesh, P(DATA_AXIS))
        return NamedSharding(self.mesh, P())

    def _flat(self, args: tuple) -> list[Any]:
        leaves = jax.tree_util.tree_leaves(args)
        if len(leaves) != len(self.in_shardings):
            raise ValueError(f"the step was planned for {len(self.in_shardings)} input leaves, got {len(leaves)}")
        if not is_multi_process():
            return leaves
        return [transfer(x, s) for x, s in zip(leaves, self.in_shardings)]

    def __call__(self, *args: Any) -> Any:
        out = self.jitted(*self._flat(args))
        return jax.tree_util.tree_unflatten(self._out_tree, out)

    def lower(self, *args: Any) -> LoweredStep:
        return LoweredStep([self.jitted.lower(*self._flat(args))])
