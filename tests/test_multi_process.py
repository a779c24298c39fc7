"""Several processes on jax.distributed (2 processes x 4 CPU devices, started by
`python -m autopar.launch`): the default method, a 2-stage pipeline with one stage per
process (with and without token slices) and the SPMD pipeline equal one device over two
steps; a killed process makes the other fail, not hang,
and a checkpoint saved before the kill resumes on 1 and on 2 processes."""
import os
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from pipeline_gpt import init_state, make_batch, make_step

HERE = os.path.dirname(__file__)


def launch(mode: str, out: str, timeout_s: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar.launch", "-n", "2", "--devices-per-process", "4",
                           "--grace", "20", os.path.join(HERE, "multi_process_step.py"), mode, out],
                          capture_output=True, text=True, timeout=timeout_s, cwd=HERE)


def one_device_reference(steps: int = 2):
    opt = optax.sgd(0.1, momentum=0.9)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(1), 8)
    step = jax.jit(make_step(opt, closure=True))
    losses = []
    for _ in range(steps):
        state, loss = step(state, batch)
        losses.append(float(loss))
    return losses, [np.asarray(x) for x in jax.tree_util.tree_leaves(state[0])], state


@pytest.fixture(scope="module")
def reference():
    """one_device_reference() for two steps, and the state after one."""
    losses, params, _ = one_device_reference()
    return losses, params, one_device_reference(steps=1)[2]


def _check_run(got, run: str, losses, params) -> None:
    np.testing.assert_allclose(got[f"{run}_losses"], losses, rtol=1e-4)
    for i, ref in enumerate(params):
        np.testing.assert_allclose(got[f"{run}_p{i}"], ref, rtol=1e-4, atol=1e-6)


RUNS = ("auto", "spmd", "pipeshard", "token")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Two launches (each costs a start of two JAX processes, so every run shares them):
    one where process 1 is killed after both saved a checkpoint of step 1, then one that
    resumes from it and does every run of RUNS. (kill launch, its seconds, results file,
    second launch)."""
    out = str(tmp_path_factory.mktemp("multi_process") / "result.npz")
    t0 = time.monotonic()
    killed = launch("kill", out, timeout_s=300)
    elapsed = time.monotonic() - t0
    rest = launch(",".join(("resume",) + RUNS), out, timeout_s=600)
    return killed, elapsed, out, rest


@pytest.mark.parametrize("run", RUNS)
def test_two_processes_equal_one_device_for_two_steps(run, launched, reference):
    """Each run equals one device for two steps. Pipelines put one stage per process, so
    activations (token slices, or the SPMD pipeline's ppermutes inside one program) cross
    between the processes."""
    from models import make

    rest = launched[3]
    assert rest.returncode == 0, rest.stdout[-4000:] + rest.stderr[-4000:]
    got = np.load(launched[2])
    assert int(got["num_processes"]) == 2 and int(got["num_devices"]) == 8
    if run == "spmd":       # the nn.scan GPT
        step, state, batch = make("gpt_scan", "sgd")
        scan_losses = []
        for _ in range(2):
            state, loss = jax.jit(step)(state, batch)
            scan_losses.append(float(loss))
        _check_run(got, run, scan_losses, [np.asarray(x) for x in jax.tree_util.tree_leaves(state[0])])
    else:
        _check_run(got, run, *reference[:2])
    if run != "auto":
        assert got[f"{run}_stages"].tolist() == [[0], [1]]


def test_killed_process_makes_the_other_fail_and_its_checkpoint_resumes(launched, reference):
    """Process 1 dies after both saved a checkpoint of the first step's sharded state: the
    other fails with a clear error, not a hang; the checkpoint restores on this one process
    (8 devices) and on 2 processes, and the second step from it equals one device's."""
    run, elapsed, out, resumed = launched
    log = run.stdout + run.stderr
    assert run.returncode != 0
    assert "[launch] process 1 exited with code -9" in log
    assert "stopped sending heartbeats" in log          # JAX names the lost peer in process 0
    assert "done kill" not in log
    assert "kill_losses" not in np.load(out)           # the killed launch wrote no results
    assert elapsed < 200, elapsed

    import autopar

    losses, params, after_one = reference
    restored = autopar.restore_checkpoint(out + ".ckpt", like=after_one)
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(after_one)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    _check_run(np.load(out), "resume", losses[1:], params)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_children_die_with_a_killed_launcher(tmp_path):
    """A launcher killed outright (e.g. by a test's timeout) takes its processes with it."""
    script = tmp_path / "sleeper.py"
    script.write_text("import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(300)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "autopar.launch", "-n", "2", "--devices-per-process", "1",
                                 str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE)
    pids, t0 = [], time.monotonic()
    while len(pids) < 2 and time.monotonic() - t0 < 120:
        line = launcher.stdout.readline()
        if not line:
            break
        if "] pid " in line:
            pids.append(int(line.split()[-1]))
    launcher.kill()
    launcher.wait()
    assert len(pids) == 2, pids
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_launcher_environment_and_bad_input(tmp_path):
    from autopar import distributed
    from autopar.launch import child_env, launch as run_launcher

    env = child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d"}, process_id=1,
                    num_processes=3, devices=4, coordinator="127.0.0.1:9", transfer_port=11, heartbeat_s=5)
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/d", "--xla_force_host_platform_device_count=4"]
    assert env[distributed.ENV_PROCESS_ID] == "1" and env[distributed.ENV_NUM_PROCESSES] == "3"
    assert env[distributed.ENV_TRANSFER_ADDRESS] == "127.0.0.1:11"
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    with pytest.raises(FileNotFoundError, match="no such script"):
        run_launcher(str(tmp_path / "missing.py"), [], num_processes=2, devices_per_process=4)
    with pytest.raises(ValueError, match="at least one process"):
        run_launcher(__file__, [], num_processes=0, devices_per_process=4)


def test_launcher_asks_for_huge_page_malloc_and_keeps_the_users_tunables():
    from autopar.launch import with_huge_page_malloc

    assert with_huge_page_malloc({"PATH": "/bin"}) == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    other = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert with_huge_page_malloc(other)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert other == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}          # the caller's dict is left alone
    for own in ("glibc.malloc.hugetlb=0", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2"):
        assert with_huge_page_malloc({"GLIBC_TUNABLES": own})["GLIBC_TUNABLES"] == own
