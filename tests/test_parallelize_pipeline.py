"""PipeshardParallel through the public decorator: same result as one device, plan in JSON,
Gantt chart from `autopar inspect --gantt`."""
import jax
import optax

import autopar
from autopar.cli import main
from pipeline_gpt import init_state, make_batch, make_step
from test_pipeline_runtime import _assert_close


def test_decorator_pipeline_matches_single_device_and_records_the_plan(tmp_path, capsys):
    opt = optax.adamw(1e-2)
    state = init_state(opt)
    batch = make_batch(jax.random.PRNGKey(3), 8)
    step = make_step(opt, markers=True)
    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2))
    new_state, loss = pstep(state, batch)
    ref_state, ref_loss = jax.jit(step)(state, batch)
    _assert_close(loss, ref_loss)
    _assert_close(new_state[0], ref_state[0], rtol=1e-4, atol=2e-2)   # adam: +-lr on near-zero grads
    plan = pstep.plan
    assert len(plan.stages) == 2 and plan.pipeline.num_micro_batches == 2
    ids = [set(s.device_ids) for s in plan.stages]
    assert not ids[0] & ids[1]
    compiled = pstep.lower(state, batch).compile()
    assert len(compiled.stages) == 2
    path = tmp_path / "pipe.json"
    plan.save(path)
    assert autopar.Plan.load(path) == plan
    png = tmp_path / "gantt.png"
    assert main(["inspect", str(path), "--gantt", str(png)]) == 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "pipeline" in capsys.readouterr().out
