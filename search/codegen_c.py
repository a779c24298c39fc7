"""Print a lowered program as plain C with OpenMP pragmas (one exported function `kernel`).

The printer also keeps register tiles: the accumulator tile of an innermost reduction loop is
copied into a small local array before the loop and back after it, so gcc keeps it in vector
registers instead of loading and storing the output tile on every reduction step."""
from __future__ import annotations

from .expr import Bin, Const, Expr, Load, Var, affine, simplify, to_c, variables
from .lower import Alloc, For, Program, Store

KERNEL_SYMBOL = "kernel"
MAX_REGISTER_TILE = 512  # fp32 elements: the 32 AVX-512 registers hold 512 floats
MAX_UNROLL = 64  # `#pragma GCC unroll` depth cap: deeper made gcc take over 10 s per kernel
MAX_STACK_ELEMS = 16384  # larger per-tile buffers are heap-allocated (OpenMP threads' stacks are small)


def _name(buffer_name: str) -> str:
    return buffer_name.replace('.', '_')


def _load(ld: Load) -> str:
    return f"{_name(ld.tensor)}[{to_c(ld.index[0])}]"


def _pragma(n: For) -> str | None:
    if n.ann == "parallel":
        return "#pragma omp parallel for schedule(static)"
    if n.ann == "vectorize":
        return "#pragma omp simd"
    if n.ann == "unroll":
        return f"#pragma GCC unroll {min(n.extent, MAX_UNROLL)}"
    return None


def _guard(n: Store) -> str:
    return " && ".join(f"{to_c(e)} < {bound}" for e, bound in n.guard)


def _store_line(n: Store, dst: str, guarded: bool = True) -> str:
    val = to_c(n.value, _load)
    if n.reduce_op == "sum":
        line = f"{dst} += {val};"
    elif n.reduce_op == "max":
        line = f"{dst} = fmaxf({dst}, {val});"
    else:
        line = f"{dst} = {val};"
    return f"if ({_guard(n)}) {line}" if guarded and n.guard else line


def register_tile(n: For) -> tuple[list[For], Store] | None:
    """The spatial loops and store under `n` when `n` is an innermost reduction loop whose
    accumulator tile is small and injectively indexed by those loops (else None)."""
    inner, node = [], n.body
    while len(node) == 1 and isinstance(node[0], For):
        inner.append(node[0])
        node = node[0].body
    if not inner or len(node) != 1 or not isinstance(node[0], Store) or node[0].reduce_op is None:
        return None
    st = node[0]
    used = variables(st.index)
    if n.var in used or any(lp.var not in used for lp in inner):
        return None
    size = 1
    for lp in inner:
        size *= lp.extent
    if size > MAX_REGISTER_TILE:
        return None
    try:
        coeffs, _ = affine(st.index)
    except ValueError:
        return None
    offsets = {0}
    for lp in inner:  # distinct inner iterations must accumulate into distinct elements
        c = coeffs.get(lp.var, 0)
        offsets = {o + c * i for o in offsets for i in range(lp.extent)}
    return (inner, st) if len(offsets) == size else None


def _nest(loops: list[For], line: str, depth: int, out: list[str]) -> None:
    for k, lp in enumerate(loops):
        pad = "  " * (depth + k)
        prag = _pragma(lp)
        if prag:
            out.append(pad + prag)
        out.append(f"{pad}for (int {lp.var} = 0; {lp.var} < {lp.extent}; ++{lp.var}) {{")
    out.append("  " * (depth + len(loops)) + line)
    for k in range(len(loops) - 1, -1, -1):
        out.append("  " * (depth + k) + "}")


def _register_tiled(n: For, inner: list[For], st: Store, depth: int, out: list[str]) -> None:
    pad = "  " * depth
    # the tile only stays in registers when every non-vector loop of it is unrolled
    inner = [lp if lp.ann == "vectorize" else For(lp.var, lp.extent, "unroll", lp.body, lp.stage) for lp in inner]
    reg = f"{_name(st.buffer.name)}_reg"
    ridx: Expr = Const(0, True)
    stride = 1
    for lp in reversed(inner):
        ridx = Bin("+", ridx, Bin("*", Var(lp.var), Const(stride, True)))
        stride *= lp.extent
    r = f"{reg}[{to_c(simplify(ridx))}]"
    dst = f"{_name(st.buffer.name)}[{to_c(st.index)}]"
    out.append(f"{pad}{{")
    out.append(f"{pad}  float {reg}[{stride}] __attribute__((aligned(64)));")
    # a padded output tile accumulates in registers everywhere but loads and stores only inside
    _nest(inner, f"{r} = ({_guard(st)}) ? {dst} : 0.0f;" if st.guard else f"{r} = {dst};", depth + 1, out)
    prag = _pragma(n)
    if prag:
        out.append(f"{pad}  {prag}")
    out.append(f"{pad}  for (int {n.var} = 0; {n.var} < {n.extent}; ++{n.var}) {{")
    _nest(inner, _store_line(st, r, guarded=False), depth + 2, out)
    out.append(f"{pad}  }}")
    _nest(inner, f"if ({_guard(st)}) {dst} = {r};" if st.guard else f"{dst} = {r};", depth + 1, out)
    out.append(f"{pad}}}")


def _node(n, depth: int, out: list[str]) -> None:
    pad = "  " * depth
    if isinstance(n, For):
        tile = register_tile(n) if n.ann != "parallel" else None
        if tile is not None:
            _register_tiled(n, *tile, depth, out)
            return
        prag = _pragma(n)
        if prag:
            out.append(pad + prag)
        out.append(f"{pad}for (int {n.var} = 0; {n.var} < {n.extent}; ++{n.var}) {{")
        for c in n.body:
            _node(c, depth + 1, out)
        for c in n.body:
            if isinstance(c, Alloc) and c.buffer.size > MAX_STACK_ELEMS:
                out.append(f"{pad}  free({_name(c.buffer.name)});")
        out.append(f"{pad}}}")
    elif isinstance(n, Alloc) and n.buffer.size > MAX_STACK_ELEMS:
        # a restrict heap pointer also lets gcc keep register tiles that read the buffer in
        # registers (with a large stack array next to them it spilled the accumulators)
        out.append(f"{pad}float* __restrict {_name(n.buffer.name)} = "
                   f"(float*)aligned_alloc(64, {(4 * n.buffer.size + 63) // 64 * 64});")
    elif isinstance(n, Alloc):
        out.append(f"{pad}float {_name(n.buffer.name)}[{n.buffer.size}] __attribute__((aligned(64)));")
    elif isinstance(n, Store):
        out.append(pad + _store_line(n, f"{_name(n.buffer.name)}[{to_c(n.index)}]"))
    else:
        raise TypeError(n)


def to_c_source(prog: Program) -> str:
    """C translation unit with `void kernel(const float* in..., float* out)`."""
    params = [f"{'const ' if b.scope == 'input' else ''}float* __restrict {_name(b.name)}" for b in prog.args]
    lines = ["#include <math.h>", "#include <stdlib.h>", "",
             f"void {KERNEL_SYMBOL}({', '.join(params)}) {{"]
    for t in prog.temps:
        lines.append(f"  float* __restrict {_name(t.name)} = "
                     f"(float*)aligned_alloc(64, ((size_t){t.size} * 4 + 63) / 64 * 64);")
    for n in prog.body:
        _node(n, 1, lines)
    for t in prog.temps:
        lines.append(f"  free({_name(t.name)});")
    lines.append("}")
    return "\n".join(lines) + "\n"
