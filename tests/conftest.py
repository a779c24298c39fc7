"""Test setup: 8 simulated CPU devices, set before jax is first imported.

LLVM runs at -O0 (`--xla_backend_optimization_level=0`): the suite compiles hundreds of
small programs and runs each once or twice, so code generation, not running it, is what
costs (a 4-stage token pipeline test: 24.5 s -> 17.7 s). HLO, layouts, collectives and
buffer assignment, which the tests check, come before LLVM and do not change."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
