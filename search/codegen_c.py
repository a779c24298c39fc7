"""Print a lowered program as plain C with OpenMP pragmas (one exported function `kernel`)."""
from __future__ import annotations

from .expr import Load, to_c
from .lower import Alloc, For, Program, Store

KERNEL_SYMBOL = "kernel"


def _load(ld: Load) -> str:
    return f"{ld.tensor.replace('.', '_')}[{to_c(ld.index[0])}]"


def _node(n, depth: int, out: list[str]) -> None:
    pad = "  " * depth
    if isinstance(n, For):
        if n.ann == "parallel":
            out.append(f"{pad}#pragma omp parallel for schedule(static)")
        elif n.ann == "vectorize":
            out.append(f"{pad}#pragma omp simd")
        elif n.ann == "unroll":
            out.append(f"{pad}#pragma GCC unroll {min(n.extent, 64)}")
        out.append(f"{pad}for (int {n.var} = 0; {n.var} < {n.extent}; ++{n.var}) {{")
        for c in n.body:
            _node(c, depth + 1, out)
        out.append(f"{pad}}}")
    elif isinstance(n, Alloc):
        out.append(f"{pad}float {n.buffer.name.replace('.', '_')}[{n.buffer.size}] __attribute__((aligned(64)));")
    elif isinstance(n, Store):
        dst = f"{n.buffer.name.replace('.', '_')}[{to_c(n.index)}]"
        val = to_c(n.value, _load)
        if n.reduce_op == "sum":
            out.append(f"{pad}{dst} += {val};")
        elif n.reduce_op == "max":
            out.append(f"{pad}{dst} = fmaxf({dst}, {val});")
        else:
            out.append(f"{pad}{dst} = {val};")
    else:
        raise TypeError(n)


def to_c_source(prog: Program) -> str:
    """C translation unit with `void kernel(const float* in..., float* out)`."""
    params = [f"{'const ' if b.scope == 'input' else ''}float* __restrict {b.name.replace('.', '_')}" for b in prog.args]
    lines = ["#include <math.h>", "#include <stdlib.h>", "",
             f"void {KERNEL_SYMBOL}({', '.join(params)}) {{"]
    for t in prog.temps:
        lines.append(f"  float* __restrict {t.name.replace('.', '_')} = "
                     f"(float*)aligned_alloc(64, ((size_t){t.size} * 4 + 63) / 64 * 64);")
    for n in prog.body:
        _node(n, 1, lines)
    for t in prog.temps:
        lines.append(f"  free({t.name.replace('.', '_')});")
    lines.append("}")
    return "\n".join(lines) + "\n"
