"""Lowered and compiled forms of a built step: what `Executable.lower(...)` returns and what
its `.compile()` gives (one jax Compiled per stage, their HLO and memory)."""
from __future__ import annotations

from typing import Any


class CompiledStep:
    """The compiled program(s) of a plan: one jax Compiled per stage."""

    def __init__(self, stages: list[Any], programs: list[dict[str, Any]] | None = None):
        self.stages = stages
        self.programs = programs if programs is not None else [{"step": s} for s in stages]

    def as_text(self) -> str:
        return "\n".join(c.as_text() for progs in self.programs for c in progs.values())

    def memory_analysis(self) -> list[Any]:
        """Per-stage `memory_analysis()` (a list, one entry per stage)."""
        return [s.memory_analysis() for s in self.stages]

    def cost_analysis(self) -> list[Any]:
        return [s.cost_analysis() for s in self.stages]


class LoweredStep:
    """Lowered program(s) of a plan; `compile()` gives a CompiledStep."""

    def __init__(self, lowered: list[Any], compile_fn=None, text: str | None = None):
        self.lowered = lowered
        self._compile_fn = compile_fn
        self._text = text

    def as_text(self) -> str:
        return self._text if self._text is not None else "\n".join(l.as_text() for l in self.lowered)

    def compile(self) -> CompiledStep:
        if self._compile_fn is not None:
            return self._compile_fn()
        return CompiledStep([l.compile() for l in self.lowered])
