"""Plan the SPMD pipeline (`spmd.py`): how many stages S and micro-batches M, from the
traced step's layer scan, priced under the cluster model.

Per tick every stage runs L/S layers on the rows one device holds of a micro-batch
(forward), then, in the backward pass, recomputes them and runs their backward; the
carry moves one stage per tick in each direction. With T = M + S - 1 ticks:

    step = T * (L/S * (forward + train) + 2 * send) + rest + gradient all-reduce over y

`forward` and `train` are the roofline times of the traced layer (the scan body at the
local rows, and its vjp); `rest` is the loss outside the scan (x3 for its backward) on
D-way split rows plus the optimizer update on the stage's share of the stacked weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
from jax._src import core as jax_core

from autopar.cluster import Cluster
from autopar.intra_op import MemoryBudgetError
from autopar.pipeline.layer_cost import roofline_s
from autopar.pipeline.spmd import LayerScan, SpmdPipelineError, check_divisible, find_layer_scan, local_body
from autopar.pipeline.trace import MicroBatchTraceError, StepTracer
from autopar.plan import Plan, SpmdPipelinePlan, StagePlan, StageRemat, TensorPlan
from autopar.sharding_spec import AXIS_NAMES
from rockmate.graph import graph_from_jaxpr


@dataclass(frozen=True)
class LayerTimes:
    """One layer of the scan on `rows` rows of a micro-batch, on one device."""

    forward_s: float
    train_s: float
    carry_bytes: float
    residual_bytes: float           # batch-major values the forward keeps for the backward


class SpmdPlanner:
    """Prices SPMD pipeline candidates of one traced step; layer times are cached by the
    rows per device (one planning run)."""

    def __init__(self, tracer: StepTracer, cluster: Cluster, num_devices: int):
        self.tracer, self.cluster, self.n = tracer, cluster, num_devices
        call = tracer.call
        self.scan: LayerScan = find_layer_scan(call.loss_jaxpr, call.num_consts)
        self._layers: dict[int, LayerTimes] = {}
        self._rest_forward_s: float | None = None
        self._update_s: float | None = None

    # --- which step inputs go where -------------------------------------------------------
    def input_roles(self, data: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(stacked, batch) flat step inputs: leaves of the non-batch arguments shaped like a
        stacked weight (parameters and their optimizer state), and batch leaves whose
        leading dimension splits over `data`."""
        stacked_shapes = set(self.scan.stacked_shapes)
        stacked, batch, k = [], [], 0
        for i, a in enumerate(self.tracer.args):
            for leaf in jax.tree_util.tree_leaves(a):
                if i in self.tracer.batch_argnums:
                    if leaf.shape and leaf.shape[0] % data == 0:
                        batch.append(k)
                elif tuple(leaf.shape) in stacked_shapes:
                    stacked.append(k)
                k += 1
        return tuple(stacked), tuple(batch)

    def layer_times(self, micro_batches: int, data: int) -> LayerTimes:
        rows = self.scan.batch_size // (micro_batches * data)
        if rows not in self._layers:
            body = local_body(self.tracer.at(micro_batches * data).loss_jaxpr, self.tracer.call.num_consts, self.scan)
            device = self.cluster.device
            nc = self.scan.num_consts
            ncar = self.scan.num_carry

            def layer(consts, carry, w):
                return jax_core.eval_jaxpr(body.jaxpr, body.consts, *consts, *carry, *w)[:ncar]

            avals = body.in_avals
            consts, carry, w = avals[:nc], avals[nc:nc + ncar], avals[nc + ncar:]
            args = (list(consts), list(carry), list(w))
            train = jax.make_jaxpr(lambda c, x, ww, ct: jax.vjp(lambda x_, w_: layer(c, x_, w_), x, ww)[1](ct))(
                *args, list(carry))
            # the activations the layer's backward keeps from its forward (batch-major ones)
            residuals = jax.eval_shape(lambda c, x, ww: jax.tree_util.tree_leaves(
                jax.vjp(lambda x_, w_: layer(c, x_, w_), x, ww)[1]), *args)
            self._layers[rows] = LayerTimes(
                forward_s=roofline_s(graph_from_jaxpr(body), device),
                train_s=roofline_s(graph_from_jaxpr(train), device),
                carry_bytes=float(sum(a.size * a.dtype.itemsize for a in carry)),
                residual_bytes=float(sum(r.size * r.dtype.itemsize for r in residuals
                                         if r.shape and r.shape[0] == rows)))
        return self._layers[rows]

    def _rest(self) -> tuple[float, float]:
        """(forward roofline of the full-batch loss outside the layer scan, roofline of the
        step outside its gradient call: the optimizer update), one device."""
        if self._rest_forward_s is None:
            loss = self.tracer.at(1).loss
            scans = [op for op in loss.ops if op.name == "scan"]
            biggest = max(scans, key=lambda op: sum(loss.vars[v].nbytes for v in op.inputs))
            device = self.cluster.device
            self._rest_forward_s = roofline_s(loss, device, skip=(biggest.index,))
            self._update_s = roofline_s(self.tracer.step, device, skip=(self.tracer.grad_op,))
        return self._rest_forward_s, self._update_s

    # --- one candidate ---------------------------------------------------------------------
    def price(self, num_stages: int, micro_batches: int) -> SpmdPipelinePlan:
        S, M = num_stages, micro_batches
        D = self.n // S
        scan = self.scan
        if self.n % S:
            raise SpmdPipelineError(f"{self.n} devices do not form {S} equal stages")
        check_divisible(scan, S, M, D)
        lt = self.layer_times(M, D)
        mesh = self.cluster.logical_mesh((S, D))
        per_stage = scan.length // S
        send = mesh.send_s(lt.carry_bytes, 0)
        tick = per_stage * (lt.forward_s + lt.train_s) + 2 * send
        T = M + S - 1
        rest_fwd, update = self._rest()
        rest = 3 * rest_fwd / D + update / S
        stacked, batch = self.input_roles(D)
        leaves = [leaf for a in self.tracer.args for leaf in jax.tree_util.tree_leaves(a)]
        nbytes = lambda leaf: leaf.size * jax.numpy.dtype(leaf.dtype).itemsize
        stacked_bytes = sum(nbytes(leaves[k]) for k in stacked)
        arg_bytes = sum(nbytes(leaf) / (S if k in stacked else D if k in batch else 1)
                        for k, leaf in enumerate(leaves))
        diff_bytes = self._param_bytes()
        sync = mesh.all_reduce_s(scan.stacked_bytes / S, 1) + mesh.all_reduce_s(diff_bytes - scan.stacked_bytes, 1)
        return SpmdPipelinePlan(
            num_stages=S, data_parallel=D, num_micro_batches=M, micro_batch_size=scan.batch_size // M,
            num_layers=scan.length, stacked_inputs=stacked, batch_inputs=batch, layer_forward_s=lt.forward_s,
            layer_train_s=lt.train_s, send_s=send, tick_s=tick, rest_s=rest, grad_sync_s=sync,
            predicted_step_s=T * tick + rest + sync, predicted_argument_bytes=arg_bytes,
            predicted_activation_bytes=2.0 * T * lt.carry_bytes + per_stage * lt.residual_bytes,
            predicted_gradient_bytes=scan.stacked_bytes / S + diff_bytes - scan.stacked_bytes,
            send_bytes=lt.carry_bytes)

    def _param_bytes(self) -> float:
        """Bytes of the differentiated loss inputs (the parameters)."""
        call = self.tracer.call
        invars = call.loss_jaxpr.invars
        return float(sum(v.aval.size * v.aval.dtype.itemsize
                         for v, diff in zip(invars, call.diff_leaf_mask) if diff))

    def candidates(self, num_stages: int | None, micro_batches: int | str) -> list[tuple[int, int]]:
        """(S, M) pairs that split the layers, the devices and the batch evenly."""
        L, N = self.scan.length, self.scan.batch_size
        stages = [num_stages] if num_stages else [s for s in range(2, min(L, self.n) + 1)
                                                   if L % s == 0 and self.n % s == 0]
        Ms = [micro_batches] if micro_batches != "auto" else [m for m in range(1, N + 1) if N % m == 0]
        return [(s, m) for s in stages for m in Ms
                if L % s == 0 and self.n % s == 0 and N % m == 0 and (N // m) % (self.n // s) == 0]

    def plan(self, num_stages: int | None, micro_batches: int | str, memory_limit: float) -> SpmdPipelinePlan:
        """The fastest candidate whose predicted memory fits `memory_limit` per device."""
        if num_stages is not None:      # a given count that cannot work: say exactly why
            if self.n % num_stages:
                raise SpmdPipelineError(f"{self.n} devices do not form {num_stages} equal stages; choose "
                                        f"num_stages among the divisors of {self.n}")
            if micro_batches != "auto":
                check_divisible(self.scan, num_stages, micro_batches, self.n // num_stages)
            elif self.scan.length % num_stages:
                check_divisible(self.scan, num_stages, 1, 1)
        cands = self.candidates(num_stages, micro_batches)
        if not cands:
            S = num_stages or "any"
            raise SpmdPipelineError(
                f"no SPMD pipeline splits {self.scan.length} layers, {self.n} devices and a batch of "
                f"{self.scan.batch_size} evenly (stages={S}, micro-batches={micro_batches}): the stages must divide "
                f"the layers and the devices, and each micro-batch must split over the devices of a stage")
        best, smallest, errors = None, None, []
        for S, M in cands:
            try:
                p = self.price(S, M)
            except (MicroBatchTraceError, SpmdPipelineError) as e:
                errors.append(e)
                continue
            used = p.predicted_argument_bytes + p.predicted_gradient_bytes + p.predicted_activation_bytes
            smallest = used if smallest is None else min(smallest, used)
            if used <= memory_limit and (best is None or p.predicted_step_s < best.predicted_step_s):
                best = p
        if best is None:
            if smallest is None:
                raise errors[0]
            raise MemoryBudgetError(memory_limit, smallest, (0, 0), remat_on=True,
                                    what=f"no SPMD pipeline of {self.scan.length} layers on {self.n} devices")
        return best


def spmd_plan(sp: SpmdPipelinePlan, tracer: StepTracer, *, name: str, signature: str, cluster: Cluster,
              memory_budget_bytes: float | None, device_ids: Sequence[int], planning_s: float) -> Plan:
    """The Plan of an SPMD pipeline: one program (one StagePlan) on the (S, D) mesh."""
    x, y = AXIS_NAMES
    inputs = []
    for k, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(tracer.args)[0]):
        spec = tuple(() for _ in leaf.shape)
        if k in sp.stacked_inputs:
            spec = ((x,),) + spec[1:]
        elif k in sp.batch_inputs:
            spec = ((y,),) + spec[1:]
        inputs.append(TensorPlan(name=f"args{jax.tree_util.keystr(path)}", shape=tuple(leaf.shape),
                                 dtype=str(jax.numpy.dtype(leaf.dtype)), spec=spec))
    S, D, M = sp.num_stages, sp.data_parallel, sp.num_micro_batches
    ticks = M + S - 1
    stage = StagePlan(
        mesh_shape=(S, D), axis_names=AXIS_NAMES, device_ids=tuple(device_ids[:S * D]), inputs=tuple(inputs),
        outputs=(), predicted_time_s=sp.predicted_step_s,
        compute_s=ticks * (sp.tick_s - 2 * sp.send_s) + sp.rest_s, comm_s=2 * ticks * sp.send_s + sp.grad_sync_s,
        comm_bytes=2 * ticks * sp.send_bytes,
        memory_bytes=sp.predicted_argument_bytes + sp.predicted_gradient_bytes + sp.predicted_activation_bytes,
        argument_bytes=sp.predicted_argument_bytes, collectives={"collective-permute": 2 * ticks * sp.send_bytes},
        layer_range=(0, sp.num_layers), submesh=(S, D), in_flight=ticks,
        remat=StageRemat(mode="full"))
    return Plan(method=name, signature=signature, cluster=cluster.to_json(), stages=(stage,),
                memory_budget_bytes=memory_budget_bytes, num_micro_batches=M, schedule="gpipe",
                planning_time_s=planning_s, spmd_pipeline=sp)
