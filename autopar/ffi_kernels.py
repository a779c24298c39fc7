"""Tuned C kernels called from inside a jitted program through `jax.ffi` (CPU).

One generic FFI handler (`autopar_kernel`, C++ against XLA's FFI headers) is compiled once
per jaxlib version and cached on disk; it calls a generated kernel
`void kernel(const float* in..., float* out)` whose address it receives as the attribute
`fn`. Any kernel that `search.build` returns can then run inside `jax.jit` as a custom call
whose target name starts with `autopar`, on the local shapes of one device.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "autopar_kernel"
MAX_INPUTS = 8

_SHIM = r"""
#include <cstdint>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using In = const float*;

// Calls kernel(in0, ..., in{n-1}, out) at address `fn` with the call's buffers.
static ffi::Error Call(ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out, int64_t fn) {
  const int n = static_cast<int>(args.size());
  if (n < 1 || n > %(max)d) return ffi::Error::InvalidArgument("autopar_kernel: 1 to %(max)d inputs");
  In p[%(max)d];
  for (int i = 0; i < n; ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return ffi::Error::InvalidArgument("autopar_kernel: input is not a buffer");
    if (b->element_type() != ffi::DataType::F32) return ffi::Error::InvalidArgument("autopar_kernel: float32 only");
    p[i] = static_cast<In>(b->untyped_data());
  }
  float* o = static_cast<float*>(out->untyped_data());
  void* f = reinterpret_cast<void*>(fn);
  switch (n) {
%(cases)s
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AutoparKernel, Call,
    ffi::Ffi::Bind().RemainingArgs().Ret<ffi::AnyBuffer>().Attr<int64_t>("fn"));
"""


def shim_source() -> str:
    cases = []
    for n in range(1, MAX_INPUTS + 1):
        params = ", ".join(["In"] * n + ["float*"])
        args = ", ".join([f"p[{i}]" for i in range(n)] + ["o"])
        cases.append(f"    case {n}: reinterpret_cast<void (*)({params})>(f)({args}); break;")
    return _SHIM % {"max": MAX_INPUTS, "cases": "\n".join(cases)}


class FfiUnavailableError(RuntimeError):
    """The FFI shim could not be built (no C++ compiler, or it failed); the message says which."""


class FfiShim:
    """The compiled handler, loaded and registered with XLA for this process. Built into
    `cache_dir` (default $AUTOPAR_CACHE or ~/.cache/autopar, then ffi/) under a name keyed
    by its source and the jaxlib version, so a machine builds it once. XLA's registry of
    FFI targets is per process, so `get()` hands out one instance per process."""

    _instance: "FfiShim | None" = None

    @classmethod
    def get(cls) -> "FfiShim":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self, cache_dir: str | os.PathLike | None = None):
        base = Path(cache_dir or os.environ.get("AUTOPAR_CACHE", Path.home() / ".cache" / "autopar")) / "ffi"
        source = shim_source()
        key = hashlib.sha256((source + jax.lib.__version__ + jax.ffi.include_dir()).encode()).hexdigest()[:16]
        self.path = base / f"autopar_kernel_{key}.so"
        if not self.path.exists():
            _compile(source, self.path)
        self.library = ctypes.CDLL(str(self.path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(self.library.AutoparKernel), platform="cpu")


def _compile(source: str, path: Path) -> None:
    cxx = os.environ.get("CXX", "").strip() or "g++"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "shim.cc"
        src.write_text(source)
        out = Path(tmp) / path.name
        cmd = [*cxx.split(), "-O2", "-std=c++17", "-fPIC", "-shared", f"-I{jax.ffi.include_dir()}", str(src),
               "-o", str(out)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except FileNotFoundError:
            raise FfiUnavailableError(f"no C++ compiler {cxx!r} to build autopar's FFI shim; install g++ or set "
                                      f"CXX. Steps run with XLA's own code meanwhile") from None
        if res.returncode:
            raise FfiUnavailableError(f"building autopar's FFI shim failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
        os.replace(out, path)          # atomic: a concurrent build never leaves half a library


def kernel_address(kernel: Any) -> int:
    """The address of a `search.Kernel`'s compiled function."""
    return int(ctypes.cast(kernel._fn, ctypes.c_void_p).value)


def call_kernel(kernel: Any, *inputs: jax.Array) -> jax.Array:
    """`kernel(*inputs)` as an XLA custom call (traceable under jit). The kernel must stay
    alive while programs that call it may run."""
    task = kernel.task
    if len(inputs) != len(task.input_shapes) or len(inputs) > MAX_INPUTS:
        raise TypeError(f"{task}: expected {len(task.input_shapes)} inputs, got {len(inputs)}")
    for (name, shape), x in zip(task.input_shapes, inputs):
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{task}: input {name!r} has shape {tuple(x.shape)}, the kernel was built for {shape}")
    out = jax.ShapeDtypeStruct(task.output_shape, jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(*[jnp.asarray(x, jnp.float32) for x in inputs], fn=np.int64(kernel_address(kernel)))
