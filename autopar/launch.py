"""Rehearse a multi-host run on one machine: start N processes of the same script, each
with its own simulated CPU devices, joined by `jax.distributed` (gloo collectives and
cross-host transfers on 127.0.0.1).

    python -m autopar.launch -n 2 --devices-per-process 4 script.py [script args]

The script runs unchanged in every process (as under torchrun): `jax.distributed` is
initialized before it starts, so `jax.devices()` lists all N x devices-per-process devices
and `jax.process_index()` tells the processes apart. Output lines are prefixed "[pK]". If
one process fails, the others get `--grace` seconds to fail on their own (the survivors'
collectives report the lost peer within the heartbeat timeout) and are then killed; the
launcher exits with the first failure's code.
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from autopar import distributed


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


HUGE_PAGE_MALLOC = "glibc.malloc.hugetlb"


def with_huge_page_malloc(env: dict[str, str]) -> dict[str, str]:
    """`env` with glibc's malloc asking for transparent huge pages (GLIBC_TUNABLES
    `glibc.malloc.hugetlb=1`), unless it already sets that tunable. XLA:CPU allocates its
    large buffers afresh on every call, and glibc maps each one with new 4 KiB pages that
    fault in again: 270k page faults and 14% of a GPT train step on this machine
    (docs/multi_host.md). Other tunables are kept; non-glibc systems ignore it."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if any(t.split("=", 1)[0] == HUGE_PAGE_MALLOC for t in tunables):
        return dict(env)
    return {**env, "GLIBC_TUNABLES": ":".join(tunables + [f"{HUGE_PAGE_MALLOC}=1"])}


def child_env(base: dict[str, str], *, process_id: int, num_processes: int, devices: int, coordinator: str,
              transfer_port: int, heartbeat_s: int) -> dict[str, str]:
    """The environment of process `process_id`: its device count (replacing any in
    XLA_FLAGS), the CPU platform, huge-page malloc (`with_huge_page_malloc`) and the
    AUTOPAR_* variables `initialize_from_env` reads."""
    env = with_huge_page_malloc(base)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env[distributed.ENV_COORDINATOR] = coordinator
    env[distributed.ENV_NUM_PROCESSES] = str(num_processes)
    env[distributed.ENV_PROCESS_ID] = str(process_id)
    env[distributed.ENV_TRANSFER_ADDRESS] = f"127.0.0.1:{transfer_port}"
    env[distributed.ENV_HEARTBEAT_S] = str(heartbeat_s)
    return env


def _relay(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()


def launch(script: str, script_args: Sequence[str], *, num_processes: int, devices_per_process: int,
           grace_s: float = 30.0, heartbeat_s: int = 10, timeout_s: float | None = None) -> int:
    """Run `script` in `num_processes` processes; the first non-zero exit code, else 0."""
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(f"need at least one process and one device per process; got -n {num_processes}, "
                         f"--devices-per-process {devices_per_process}")
    if not os.path.exists(script):
        raise FileNotFoundError(f"no such script: {script}")
    ports = free_ports(num_processes + 1)
    coordinator = f"127.0.0.1:{ports[0]}"
    procs, relays = [], []
    for i in range(num_processes):
        env = child_env(os.environ, process_id=i, num_processes=num_processes, devices=devices_per_process,
                        coordinator=coordinator, transfer_port=ports[i + 1], heartbeat_s=heartbeat_s)
        p = subprocess.Popen([sys.executable, "-m", "autopar.launch", "--child", script, *script_args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(p)
        t = threading.Thread(target=_relay, args=(p.stdout, f"[p{i}] ", sys.stdout), daemon=True)
        t.start()
        relays.append(t)
    start, first_failure, failed_at = time.monotonic(), 0, None
    try:
        while [p.poll() for p in procs].count(None):
            now = time.monotonic()
            for i, p in enumerate(procs):
                if p.returncode not in (None, 0) and failed_at is None:
                    first_failure, failed_at = p.returncode, now
                    print(f"[launch] process {i} exited with code {p.returncode}; the others have {grace_s:.0f} s "
                          "to finish", file=sys.stderr, flush=True)
            over = timeout_s is not None and now - start > timeout_s
            if over or (failed_at is not None and now - failed_at > grace_s):
                why = f"the run passed {timeout_s:.0f} s" if over else f"still running {grace_s:.0f} s after a failure"
                print(f"[launch] {why}: killing processes "
                      f"{[i for i, p in enumerate(procs) if p.poll() is None]}", file=sys.stderr, flush=True)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                first_failure = first_failure or 124
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        raise
    finally:
        for p in procs:
            p.wait()
        for t in relays:
            t.join(timeout=5)
    if not first_failure:   # a failure seen only as the last process ended
        for i, p in enumerate(procs):
            if p.returncode:
                print(f"[launch] process {i} exited with code {p.returncode}", file=sys.stderr, flush=True)
                return p.returncode
    return first_failure


def _die_with_launcher() -> None:
    """Linux: have the kernel kill this process when the launcher dies, however it dies (a
    test's timeout SIGKILLs the launcher; its children must not live on, possibly hung)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() == 1:            # the launcher died before the line above
        os._exit(137)


def run_child(script: str, script_args: Sequence[str]) -> None:
    """Inside one launched process: join the run, then execute the script as __main__."""
    _die_with_launcher()
    distributed.initialize_from_env()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        run_child(argv[1], argv[2:])
        return 0
    ap = argparse.ArgumentParser(prog="python -m autopar.launch", description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--num-processes", type=int, default=2)
    ap.add_argument("--devices-per-process", type=int, default=4)
    ap.add_argument("--grace", type=float, default=30.0, help="seconds the others get after one process fails")
    ap.add_argument("--heartbeat", type=int, default=10, help="jax.distributed heartbeat timeout, seconds")
    ap.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    code = launch(a.script, a.args, num_processes=a.num_processes, devices_per_process=a.devices_per_process,
                  grace_s=a.grace, heartbeat_s=a.heartbeat, timeout_s=a.timeout)
    return 128 - code if code < 0 else code     # killed by signal k: 128 + k, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
