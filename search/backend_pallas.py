"""The Pallas backend: a program state becomes Pallas kernels (search.pallas_plan, then
search.codegen_pallas), compiled by Triton on a GPU; without one they run with
`interpret=True`, which checks that they compute the right thing but says nothing about speed."""
from __future__ import annotations

from typing import Any, Callable

import jax

from .codegen_pallas import program_function
from .pallas_plan import describe, plan
from .schedule import State
from .target import target_key


def gpu_name() -> str | None:
    """The device kind of this process's first GPU (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend (or JAX_PLATFORMS leaves it out)
        return None
    return gpus[0].device_kind if gpus else None


class PallasBackend:
    """Pallas kernels on this process's GPU, or interpreted (`interpret`) when there is none."""

    name = "pallas"

    def __init__(self, interpret: bool | None = None):
        self.device = gpu_name()
        self.interpret = self.device is None if interpret is None else interpret

    @property
    def timed(self) -> bool:
        """Whether kernels run for real, so that timing them means something."""
        return not self.interpret

    def target(self) -> dict[str, Any]:
        model = "interpret" if self.interpret else self.device
        return {"kind": "pallas", "backend": "pallas", "model": model, "jax": jax.__version__}

    def target_key(self) -> str:
        return target_key(self.target())

    def source(self, state: State) -> str:
        """A listing of the kernels (grid, BlockSpecs, regions, reduction steps)."""
        return describe(plan(state))

    def function(self, state: State) -> Callable[..., Any]:
        """A jitted function of the task's inputs that launches the kernels, returning the output."""
        return program_function(plan(state), self.interpret)
