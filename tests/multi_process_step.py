"""Run under `python -m autopar.launch -n 2 --devices-per-process 4`: two train steps of the
test GPT with autopar in every process; process 0 writes the losses, the final parameters
and where each stage ran to an .npz. Modes: `auto` (ShardParallel, the batch built from
each process's rows with `autopar.global_batch`), `pipeshard` (2 stages, host values),
`token` (the same with 2 token slices per sequence), `spmd` (the SPMD pipeline of an nn.scan GPT, stage axis across the processes), `kill`
(both processes save a checkpoint of the state after the first step to `<out>.ckpt`, then
process 1 dies), `resume` (restore `<out>.ckpt` and run the second step)."""
import os
import signal
import sys

import jax
import numpy as np
import optax

import autopar
from autopar.distributed import fetch
from pipeline_gpt import _attention, init_state, make_batch, make_step

mode, out = sys.argv[1], sys.argv[2]
opt = optax.sgd(0.1, momentum=0.9)
state, batch = init_state(opt), make_batch(jax.random.PRNGKey(1), 8)
if mode == "spmd":
    from models import make

    step_fn, state, inputs = make("gpt_scan", "sgd")
    step = autopar.parallelize(step_fn, method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2,
                                                                         lowering="spmd"))
elif mode in ("pipeshard", "token"):
    token = mode == "token"        # TeraPipe: 2 token slices per sequence, through both processes
    method = autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, submeshes=[(1, 4), (1, 4)],
                                       devices_per_host=4, token_slices=2 if token else 1)
    step = autopar.parallelize(make_step(opt, markers=True, closure=True,
                                         attention=autopar.causal_attention if token else _attention), method=method)
    inputs = batch
else:
    step = autopar.parallelize(make_step(opt, closure=True))
    rows = slice(4 * jax.process_index(), 4 * jax.process_index() + 4)
    inputs = autopar.global_batch({k: np.asarray(v)[rows] for k, v in batch.items()})
losses = []
first = 0
if mode == "resume":
    state, first = autopar.restore_checkpoint(out + ".ckpt", like=state), 1
for i in range(first, 2):
    state, loss = step(state, inputs)
    losses.append(float(loss))
    if mode == "kill" and i == 0:
        autopar.save_checkpoint(out + ".ckpt", state)
        if jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
stage_processes = []
if mode in ("pipeshard", "token"):
    exe = step._executable((state, inputs), {})
    stage_processes = [sorted({d.process_index for d in p.mesh.devices.flat}) for p in exe.programs]
if mode == "spmd":     # the rows of the (stage, data) mesh
    exe = step._executable((state, inputs), {})
    stage_processes = [sorted({d.process_index for d in row}) for row in exe.mesh.devices]
params = [fetch(x) for x in jax.tree_util.tree_leaves(state[0])]
if jax.process_index() == 0:
    np.savez(out, losses=np.array(losses), stage_processes=np.array(stage_processes),
             num_devices=len(jax.devices()), num_processes=jax.process_count(),
             **{f"p{i}": p for i, p in enumerate(params)})
print(f"done {mode} losses={losses}", flush=True)
