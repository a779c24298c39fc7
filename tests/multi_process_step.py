"""Run under `python -m autopar.launch -n 2 --devices-per-process 4`: two train steps with
autopar in every process, for each run named in the first argument ("auto,spmd"); process
0 writes each run's losses, final parameters and where its stages ran to an .npz
(`<run>_losses`, `<run>_p<i>`, `<run>_stages`). Runs share the processes, so one launch
(process start, `jax.distributed`) serves several.

Runs: `auto` (ShardParallel on the test GPT, the batch built from each process's rows with
`autopar.global_batch`), `pipeshard` (2 stages, one per process, host values), `token` (the
same with 2 token slices per sequence), `spmd` (the SPMD pipeline of an nn.scan GPT, stage
axis across the processes), `kill` (as `auto`; both processes save a checkpoint of the state
after the first step to `<out>.ckpt`, then process 1 dies), `resume` (as `auto` from
`<out>.ckpt`: the second step only)."""
import os
import signal
import sys

import jax
import numpy as np
import optax

import autopar
from autopar.distributed import fetch
from pipeline_gpt import _attention, init_state, make_batch, make_step

runs, out = sys.argv[1].split(","), sys.argv[2]


def setup(run: str):
    """(step, state, inputs) of a run."""
    opt = optax.sgd(0.1, momentum=0.9)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(1), 8)
    if run == "spmd":
        from models import make

        step_fn, state, inputs = make("gpt_scan", "sgd")
        method = autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, lowering="spmd")
        return autopar.parallelize(step_fn, method=method), state, inputs
    if run in ("pipeshard", "token"):
        token = run == "token"        # TeraPipe: 2 token slices per sequence, through both processes
        method = autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, submeshes=[(1, 4), (1, 4)],
                                           devices_per_host=4, token_slices=2 if token else 1)
        step_fn = make_step(opt, markers=True, closure=True, attention=autopar.causal_attention if token else _attention)
        return autopar.parallelize(step_fn, method=method), state, batch
    rows = slice(4 * jax.process_index(), 4 * jax.process_index() + 4)
    inputs = autopar.global_batch({k: np.asarray(v)[rows] for k, v in batch.items()})
    return autopar.parallelize(make_step(opt, closure=True)), state, inputs


def stages_of(run: str, step, state, inputs) -> list:
    """Per stage, the processes its devices belong to."""
    if run in ("pipeshard", "token"):
        exe = step._executable((state, inputs), {})
        return [sorted({d.process_index for d in p.mesh.devices.flat}) for p in exe.programs]
    if run == "spmd":     # the rows of the (stage, data) mesh
        exe = step._executable((state, inputs), {})
        return [sorted({d.process_index for d in row}) for row in exe.mesh.devices]
    return []


results = {"num_devices": len(jax.devices()), "num_processes": jax.process_count()}
for run in runs:
    step, state, inputs = setup(run)
    losses, first = [], 0
    if run == "resume":
        state, first = autopar.restore_checkpoint(out + ".ckpt", like=state), 1
    for i in range(first, 2):
        state, loss = step(state, inputs)
        losses.append(float(loss))
        if run == "kill" and i == 0:
            autopar.save_checkpoint(out + ".ckpt", state)
            if jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    results[f"{run}_losses"] = np.array(losses)
    results[f"{run}_stages"] = np.array(stages_of(run, step, state, inputs))
    results.update({f"{run}_p{i}": fetch(x) for i, x in enumerate(jax.tree_util.tree_leaves(state[0]))})
    print(f"done {run} losses={losses}", flush=True)
if jax.process_index() == 0:
    np.savez(out, **results)
