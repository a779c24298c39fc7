"""Scalar index/value expressions of compute definitions: a tiny tree IR with C printing,
substitution, affine analysis and operation counts (used by lowering and features)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping


class Expr:
    """Base class; operators build trees so compute definitions read like math."""

    def __add__(self, o): return Bin("+", self, wrap(o))
    def __radd__(self, o): return Bin("+", wrap(o), self)
    def __sub__(self, o): return Bin("-", self, wrap(o))
    def __rsub__(self, o): return Bin("-", wrap(o), self)
    def __mul__(self, o): return Bin("*", self, wrap(o))
    def __rmul__(self, o): return Bin("*", wrap(o), self)
    def __truediv__(self, o): return Bin("/", self, wrap(o))
    def __rtruediv__(self, o): return Bin("/", wrap(o), self)


@dataclass(frozen=True, eq=True)
class Var(Expr):
    name: str


@dataclass(frozen=True, eq=True)
class Const(Expr):
    value: float
    is_int: bool = False


@dataclass(frozen=True, eq=True)
class Load(Expr):
    tensor: str
    index: tuple[Expr, ...]


@dataclass(frozen=True, eq=True)
class Bin(Expr):
    op: str  # + - * / max min  and (integer) idiv mod imin
    a: Expr
    b: Expr


@dataclass(frozen=True, eq=True)
class Call(Expr):
    func: str  # exp tanh sqrt rsqrt erf
    args: tuple[Expr, ...]


@dataclass(frozen=True, eq=True)
class Select(Expr):
    """`cond ? a : b` where cond is a conjunction of `lo <= x < hi` range checks."""

    checks: tuple[tuple[Expr, int, int], ...]
    a: Expr
    b: Expr


def wrap(x) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, int):
        return Const(x, True)
    return Const(float(x))


def ivar(name: str) -> Var:
    return Var(name)


def emax(a, b) -> Expr:
    return Bin("max", wrap(a), wrap(b))


def call(func: str, *args) -> Expr:
    return Call(func, tuple(wrap(a) for a in args))


def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Load):
        return e.index
    if isinstance(e, Bin):
        return (e.a, e.b)
    if isinstance(e, Call):
        return e.args
    if isinstance(e, Select):
        return tuple(c[0] for c in e.checks) + (e.a, e.b)
    return ()


def rebuild(e: Expr, f: Callable[[Expr], Expr]) -> Expr:
    """Apply `f` bottom-up to every node of `e`."""
    if isinstance(e, Load):
        e = Load(e.tensor, tuple(rebuild(i, f) for i in e.index))
    elif isinstance(e, Bin):
        e = Bin(e.op, rebuild(e.a, f), rebuild(e.b, f))
    elif isinstance(e, Call):
        e = Call(e.func, tuple(rebuild(a, f) for a in e.args))
    elif isinstance(e, Select):
        e = Select(tuple((rebuild(x, f), lo, hi) for x, lo, hi in e.checks), rebuild(e.a, f), rebuild(e.b, f))
    return f(e)


def substitute(e: Expr, mapping: Mapping[str, Expr]) -> Expr:
    """Replace variables by expressions."""
    return rebuild(e, lambda n: mapping.get(n.name, n) if isinstance(n, Var) else n)


def loads(e: Expr) -> list[Load]:
    """Every tensor load in `e` (outermost first)."""
    out: list[Load] = []
    stack = [e]
    while stack:
        n = stack.pop()
        if isinstance(n, Load):
            out.append(n)
        stack.extend(children(n))
    return out


def variables(e: Expr) -> set[str]:
    out: set[str] = set()
    stack = [e]
    while stack:
        n = stack.pop()
        if isinstance(n, Var):
            out.add(n.name)
        stack.extend(children(n))
    return out


def affine(e: Expr) -> tuple[dict[str, int], int]:
    """Coefficients and constant of an integer affine index expression; ValueError otherwise."""
    if isinstance(e, Var):
        return {e.name: 1}, 0
    if isinstance(e, Const):
        if not e.is_int:
            raise ValueError("non-integer constant in index expression")
        return {}, int(e.value)
    if isinstance(e, Bin) and e.op in "+-":
        ca, ka = affine(e.a)
        cb, kb = affine(e.b)
        s = 1 if e.op == "+" else -1
        out = dict(ca)
        for v, c in cb.items():
            out[v] = out.get(v, 0) + s * c
        return {v: c for v, c in out.items() if c}, ka + s * kb
    if isinstance(e, Bin) and e.op == "*":
        ca, ka = affine(e.a)
        cb, kb = affine(e.b)
        if not ca:
            return {v: ka * c for v, c in cb.items() if ka * c}, ka * kb
        if not cb:
            return {v: kb * c for v, c in ca.items() if kb * c}, ka * kb
    raise ValueError(f"index expression is not affine: {e}")


def from_affine(coeffs: Mapping[str, int], const: int) -> Expr:
    terms: list[Expr] = []
    for v, c in coeffs.items():
        terms.append(Var(v) if c == 1 else Bin("*", Var(v), Const(c, True)))
    out: Expr | None = None
    for t in terms:
        out = t if out is None else Bin("+", out, t)
    if out is None:
        return Const(const, True)
    return Bin("+", out, Const(const, True)) if const else out


def simplify(e: Expr) -> Expr:
    """Fold integer constants and drop +0 / *1 / *0 so generated indices stay readable."""
    def f(n: Expr) -> Expr:
        if isinstance(n, Bin) and isinstance(n.a, Const) and isinstance(n.b, Const) and n.a.is_int and n.b.is_int:
            a, b = int(n.a.value), int(n.b.value)
            ops = {"+": a + b, "-": a - b, "*": a * b}
            if n.op in ops:
                return Const(ops[n.op], True)
        if isinstance(n, Bin) and n.op in "+-" and isinstance(n.b, Const) and n.b.value == 0:
            return n.a
        if isinstance(n, Bin) and n.op == "+" and isinstance(n.a, Const) and n.a.value == 0:
            return n.b
        if isinstance(n, Bin) and n.op == "*":
            for x, y in ((n.a, n.b), (n.b, n.a)):
                if isinstance(x, Const) and x.is_int and x.value == 1:
                    return y
                if isinstance(x, Const) and x.is_int and x.value == 0:
                    return Const(0, True)
        if isinstance(n, Bin) and n.op in ("idiv", "mod") and isinstance(n.b, Const) and n.b.value == 1:
            return n.a if n.op == "idiv" else Const(0, True)
        return n
    return rebuild(e, f)


# ---- operation counts (for FLOP totals and cost-model features) ----

FLOP_KINDS = ("add", "mul", "div", "cmp", "math")


def op_counts(e: Expr) -> dict[str, int]:
    """Floating-point operations in one evaluation of a value expression, by kind."""
    out = dict.fromkeys(FLOP_KINDS, 0)
    stack = [e]
    while stack:
        n = stack.pop()
        if isinstance(n, Load):
            continue  # index arithmetic is not floating point
        if isinstance(n, Bin):
            kind = {"+": "add", "-": "add", "*": "mul", "/": "div", "max": "cmp", "min": "cmp"}.get(n.op)
            if kind:
                out[kind] += 1
        elif isinstance(n, Call):
            out["math"] += 1
        elif isinstance(n, Select):
            out["cmp"] += 1
        stack.extend(c for c in children(n) if not isinstance(n, Select) or c in (n.a, n.b))
    return out


# ---- C printing ----

_C_FUNCS = {"exp": "expf", "tanh": "tanhf", "sqrt": "sqrtf", "erf": "erff", "log": "logf"}


def to_c(e: Expr, load: Callable[[Load], str] | None = None) -> str:
    """C source of an expression; `load` prints tensor accesses."""
    def p(n: Expr) -> str:
        if isinstance(n, Var):
            return n.name
        if isinstance(n, Const):
            if n.is_int:
                return str(int(n.value))
            v = float(n.value)
            if v == float("inf"):
                return "INFINITY"
            if v == float("-inf"):
                return "(-INFINITY)"
            return repr(v) + "f"
        if isinstance(n, Load):
            if load is None:
                return f"{n.tensor}[{', '.join(p(i) for i in n.index)}]"
            return load(n)
        if isinstance(n, Bin):
            if n.op == "max":
                return f"fmaxf({p(n.a)}, {p(n.b)})"
            if n.op == "min":
                return f"fminf({p(n.a)}, {p(n.b)})"
            if n.op == "imin":  # integer clamp of an index
                a, b = p(n.a), p(n.b)
                return f"({a} < {b} ? {a} : {b})"
            if n.op == "idiv":
                return f"({p(n.a)} / {p(n.b)})"
            if n.op == "mod":
                return f"({p(n.a)} % {p(n.b)})"
            return f"({p(n.a)} {n.op} {p(n.b)})"
        if isinstance(n, Call):
            if n.func == "rsqrt":
                return f"(1.0f / sqrtf({p(n.args[0])}))"
            return f"{_C_FUNCS[n.func]}({', '.join(p(a) for a in n.args)})"
        if isinstance(n, Select):
            cond = " && ".join(f"({lo} <= {p(x)} && {p(x)} < {hi})" for x, lo, hi in n.checks)
            return f"(({cond}) ? {p(n.a)} : {p(n.b)})"
        raise TypeError(n)
    return p(e)
