"""Code-generation backends: how a program state becomes a loadable kernel on one target.
The C/OpenMP backend is the CPU one; the Pallas backend (search.backend_pallas) is the other."""
from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from .build_dirs import make_build_dir, remove_stale_build_dirs
from .codegen_c import KERNEL_SYMBOL, to_c_source
from .lower import lower
from .schedule import State
from .target import cpu_target, target_key

# -ffast-math lets gcc vectorize reductions and call libmvec's vector expf/tanhf. Every
# candidate is still checked against float64 numpy with the tolerance in measure.py.
C_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-shared")


def compile_flags(isa: list[str]) -> tuple[str, ...]:
    """C_FLAGS for a CPU; on AVX-512 machines gcc is told to use 512-bit vectors, which its
    tuning for recent Intel cores avoids by default (a tuned 512^3 matmul: 205 -> 300 GFLOP/s)."""
    return C_FLAGS + (("-mprefer-vector-width=512",) if "avx512f" in isa else ())


class CompilerNotFoundError(RuntimeError):
    """The C compiler that builds candidate kernels is not installed; the message says how to get one."""


def default_compiler() -> str:
    """$CC if set (a command, e.g. `clang` or `ccache gcc`), else `gcc`."""
    return os.environ.get("CC", "").strip() or "gcc"


def require_compiler(compiler: str) -> None:
    """Raise CompilerNotFoundError unless `compiler` names an executable (on PATH, or a path)."""
    words = shlex.split(compiler) or [""]
    if shutil.which(words[0]) is None:
        origin = "set by $CC" if os.environ.get("CC", "").strip() else "the default; $CC is not set"
        raise CompilerNotFoundError(
            f"no C compiler: {words[0]!r} ({origin}) is not on PATH. autopar compiles every "
            f"candidate kernel with it ({' '.join(C_FLAGS)}). Install gcc (Debian/Ubuntu: "
            "apt install gcc; Fedora: dnf install gcc; macOS: brew install gcc), or set CC to a "
            "C compiler with OpenMP support, e.g. CC=clang."
        )


@dataclass(frozen=True)
class BuildResult:
    path: str | None
    error: str | None
    build_time_s: float


class Backend(Protocol):
    """What every backend says: its name, the target it builds for (stored with each record)
    and its key, and the source it generates for a program state. How it builds and runs a
    kernel is its own (C: `build` + `load` a shared library; Pallas: `function`)."""

    name: str

    def target(self) -> dict[str, Any]: ...
    def target_key(self) -> str: ...
    def source(self, state: State) -> str: ...


class CBackend:
    """Plain C with OpenMP pragmas, compiled by the system C compiler ($CC, else gcc), loaded
    with ctypes. Without a `workdir` it builds in a temporary directory of its own, removed by
    `close()` or when the backend is garbage-collected (a loaded kernel keeps working: its code
    is mapped); ones left by killed runs are removed when a new one is made."""

    name = "c"

    def __init__(self, compiler: str | None = None, workdir: str | None = None, n_parallel: int | None = None):
        self.compiler = compiler or default_compiler()
        self._workdir = workdir
        self.n_parallel = n_parallel or max(1, os.cpu_count() or 1)
        self._count = 0
        self._cleanup: weakref.finalize | None = None

    @property
    def workdir(self) -> str:
        if self._workdir is None:
            remove_stale_build_dirs()
            self._workdir, lock_fd = make_build_dir()
            self._cleanup = weakref.finalize(self, _remove_build_dir, self._workdir, lock_fd)
        return self._workdir

    def close(self) -> None:
        """Remove the temporary build directory (if this backend made one)."""
        if self._cleanup is not None:
            self._cleanup()
            self._cleanup, self._workdir = None, None

    def target(self) -> dict[str, Any]:
        require_compiler(self.compiler)
        t = cpu_target(self.compiler)
        return {**t, "cflags": list(compile_flags(t["isa"]))}

    def target_key(self) -> str:
        return target_key(self.target())

    def source(self, state: State) -> str:
        return to_c_source(lower(state))

    def build(self, sources: list[str], timeout_s: float = 30.0) -> list[BuildResult]:
        """Compile sources in parallel compiler processes (at most n_parallel at once)."""
        require_compiler(self.compiler)
        results: list[BuildResult | None] = [None] * len(sources)
        pending = list(range(len(sources)))
        running: list[tuple[int, subprocess.Popen, float, str]] = []
        try:
            self._build_loop(sources, pending, running, results, timeout_s)
        except BaseException:  # Ctrl-C or an error: no compiler outlives the build
            for _, p, _, _ in running:
                _kill_group(p)
            raise
        return results  # type: ignore[return-value]

    def _build_loop(self, sources, pending, running, results, timeout_s) -> None:
        while pending or running:
            while pending and len(running) < self.n_parallel:
                i = pending.pop(0)
                self._count += 1
                stem = os.path.join(self.workdir, f"k{os.getpid()}_{self._count}")
                with open(stem + ".c", "w") as f:
                    f.write(sources[i])
                cmd = [*shlex.split(self.compiler), *self.target()["cflags"], "-o", stem + ".so", stem + ".c", "-lm"]
                # own process group: a timeout must kill cc1 too, not only the gcc driver (an
                # orphaned cc1 kept a core busy for minutes and slowed every later measurement)
                p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
                running.append((i, p, time.perf_counter(), stem))
            time.sleep(0.01)
            still = []
            for i, p, t0, stem in running:
                dt = time.perf_counter() - t0
                if p.poll() is None and dt < timeout_s:
                    still.append((i, p, t0, stem))
                    continue
                if p.poll() is None:
                    _kill_group(p)
                    results[i] = BuildResult(None, f"build timeout after {timeout_s:.0f} s", dt)
                elif p.returncode != 0:
                    results[i] = BuildResult(None, "build error: " + (p.stderr.read() or "")[-2000:], dt)
                else:
                    results[i] = BuildResult(stem + ".so", None, dt)
                p.stderr.close()
            running[:] = still

    def load(self, path: str, n_args: int) -> Callable[..., None]:
        fn = getattr(ctypes.CDLL(path), KERNEL_SYMBOL)
        fn.argtypes = [ctypes.c_void_p] * n_args
        fn.restype = None
        return fn


def _remove_build_dir(path: str, lock_fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock_fd)


def _kill_group(p: subprocess.Popen) -> None:
    """Kill a compiler and every process it started (its session's process group)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def call_kernel(fn: Callable[..., None], arrays: list[np.ndarray]) -> None:
    fn(*[a.ctypes.data for a in arrays])
