"""Search tasks: an operator with concrete shapes and dtype, its compute DAG, a numpy
reference and a stable workload key. `Task.from_op` is how the planner hands over shards."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .compute import ComputeDAG, Stage, axes, load
from .expr import Const, Select, Var, call, emax

GELU_C = 0.7978845608028654  # sqrt(2/pi), tanh approximation as in jax.nn.gelu


def _gelu(x):
    return 0.5 * x * (1.0 + call("tanh", GELU_C * (x + 0.044715 * (x * x * x))))


def _np_gelu(x):
    return 0.5 * x * (1.0 + np.tanh(GELU_C * (x + 0.044715 * x**3)))


def _epilogue(x, kind):
    if kind is None:
        return x
    if kind == "relu":
        return emax(x, 0.0)
    if kind == "gelu":
        return _gelu(x)
    raise ValueError(f"unknown epilogue {kind!r}; use None, 'relu' or 'gelu'")


def _np_epilogue(x, kind):
    return x if kind is None else np.maximum(x, 0.0) if kind == "relu" else _np_gelu(x)


def _matmul_dag(M, N, K, epilogue, bias, batch=None):
    b = ("b",) if batch else ()
    sp = axes(**({"b": batch} if batch else {}), i=M, j=N)
    ins = [("A", ((batch,) if batch else ()) + (M, K)), ("B", ((batch,) if batch else ()) + (K, N))]
    mm = Stage("C", sp, load("A", *b, "i", "k") * load("B", *b, "k", "j"), axes(k=K), "sum")
    if not bias and epilogue is None:
        return ComputeDAG(tuple(ins), (mm,), "C")
    x = load("C", *b, "i", "j")
    if bias:
        ins.append(("bias", (N,)))
        x = x + load("bias", "j")
    out = Stage("out", sp, _epilogue(x, epilogue))
    return ComputeDAG(tuple(ins), (mm, out), "out")


def _softmax_dag(M, N):
    x = load("X", "i", "j")
    st = (
        Stage("T_max", axes(i=M), x, axes(j=N), "max"),
        Stage("T_exp", axes(i=M, j=N), call("exp", x - load("T_max", "i"))),
        Stage("T_sum", axes(i=M), load("T_exp", "i", "k"), axes(k=N), "sum"),
        Stage("out", axes(i=M, j=N), load("T_exp", "i", "j") / load("T_sum", "i")),
    )
    return ComputeDAG((("X", (M, N)),), st, "out")


def _layernorm_dag(M, N, eps):
    x = load("X", "i", "j")
    xk = load("X", "i", "k")
    inv_n = Const(1.0 / N)
    d = xk - load("T_mean", "i")
    st = (
        Stage("T_mean", axes(i=M), x * inv_n, axes(j=N), "sum"),
        Stage("T_var", axes(i=M), d * d * inv_n, axes(k=N), "sum"),
        Stage("out", axes(i=M, j=N),
              (x - load("T_mean", "i")) * call("rsqrt", load("T_var", "i") + Const(eps))
              * load("gamma", "j") + load("beta", "j")),
    )
    return ComputeDAG((("X", (M, N)), ("gamma", (N,)), ("beta", (N,))), st, "out")


def _conv2d_dag(N, H, W, CI, CO, KH, KW, stride, pad):
    OH = (H + 2 * pad - KH) // stride + 1
    OW = (W + 2 * pad - KW) // stride + 1
    if OH <= 0 or OW <= 0:
        raise ValueError(f"conv2d: kernel {KH}x{KW} does not fit input {H}x{W} with padding {pad}")
    ins = (("X", (N, H, W, CI)), ("Wt", (KH, KW, CI, CO)))
    stages = []
    src = "X"
    if pad:
        h, w = Var("h"), Var("w")
        stages.append(Stage("P", axes(n=N, h=H + 2 * pad, w=W + 2 * pad, c=CI),
                            Select(((h, pad, H + pad), (w, pad, W + pad)),
                                   load("X", "n", h - pad, w - pad, "c"), Const(0.0))))
        src = "P"
    ih = Var("oh") * stride + Var("rh") if stride != 1 else Var("oh") + Var("rh")
    iw = Var("ow") * stride + Var("rw") if stride != 1 else Var("ow") + Var("rw")
    body = load(src, "n", ih, iw, "rc") * load("Wt", "rh", "rw", "rc", "co")
    stages.append(Stage("out", axes(n=N, oh=OH, ow=OW, co=CO), body, axes(rh=KH, rw=KW, rc=CI), "sum"))
    return ComputeDAG(ins, tuple(stages), "out")


def _np_conv2d(x, w, stride, pad):
    x = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    KH, KW = w.shape[:2]
    OH = (x.shape[1] - KH) // stride + 1
    OW = (x.shape[2] - KW) // stride + 1
    out = np.zeros((x.shape[0], OH, OW, w.shape[3]))
    for rh in range(KH):
        for rw in range(KW):
            patch = x[:, rh:rh + stride * OH:stride, rw:rw + stride * OW:stride, :]
            out += patch @ w[rh, rw]
    return out


def _np_layernorm(x, g, b, eps):
    m = x.mean(axis=1, keepdims=True)
    v = ((x - m) ** 2).mean(axis=1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * g + b


def _np_softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


_OPS: dict[str, tuple[Callable[..., ComputeDAG], Callable[..., Any]]] = {
    "matmul": (lambda M, N, K, epilogue=None: _matmul_dag(M, N, K, epilogue, False),
               lambda ins, M, N, K, epilogue=None: _np_epilogue(ins["A"] @ ins["B"], epilogue)),
    "batch_matmul": (lambda B, M, N, K: _matmul_dag(M, N, K, None, False, batch=B),
                     lambda ins, B, M, N, K: ins["A"] @ ins["B"]),
    "dense": (lambda M, N, K, epilogue="relu": _matmul_dag(M, N, K, epilogue, True),
              lambda ins, M, N, K, epilogue="relu": _np_epilogue(ins["A"] @ ins["B"] + ins["bias"], epilogue)),
    "softmax": (lambda M, N: _softmax_dag(M, N), lambda ins, M, N: _np_softmax(ins["X"])),
    "layernorm": (lambda M, N, eps=1e-5: _layernorm_dag(M, N, eps),
                  lambda ins, M, N, eps=1e-5: _np_layernorm(ins["X"], ins["gamma"], ins["beta"], eps)),
    "conv2d": (lambda N, H, W, CI, CO, KH, KW, stride=1, pad=0: _conv2d_dag(N, H, W, CI, CO, KH, KW, stride, pad),
               lambda ins, N, H, W, CI, CO, KH, KW, stride=1, pad=0: _np_conv2d(ins["X"], ins["Wt"], stride, pad)),
}

SUPPORTED_DTYPES = ("float32",)


@dataclass(frozen=True)
class Task:
    """One operator instance to tune: `op` names a compute definition, `params` its sizes."""

    op: str
    params: tuple[tuple[str, Any], ...]
    dtype: str = "float32"
    dag: ComputeDAG = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.op not in _OPS:
            raise ValueError(f"unknown op {self.op!r}; supported ops: {sorted(_OPS)}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{self.op}: dtype {self.dtype!r} is not supported yet; use one of {SUPPORTED_DTYPES}")
        p = dict(self.params)
        for k, v in p.items():
            if isinstance(v, int) and (v < 0 if k == "pad" else v <= 0):
                raise ValueError(f"{self.op}: size {k}={v} must be positive")
        try:
            dag = _OPS[self.op][0](**p)
        except TypeError as e:
            raise ValueError(f"{self.op}: bad parameters {p}: {e}") from None
        object.__setattr__(self, "dag", dag)

    # ---- constructors ----
    @staticmethod
    def make(op: str, dtype: str = "float32", **params) -> "Task":
        return Task(op, tuple(sorted(params.items())), dtype)

    @staticmethod
    def matmul(M: int, N: int, K: int, dtype: str = "float32", epilogue: str | None = None) -> "Task":
        return Task.make("matmul", dtype, M=M, N=N, K=K, **({"epilogue": epilogue} if epilogue else {}))

    @staticmethod
    def batch_matmul(B: int, M: int, N: int, K: int, dtype: str = "float32") -> "Task":
        return Task.make("batch_matmul", dtype, B=B, M=M, N=N, K=K)

    @staticmethod
    def dense(M: int, N: int, K: int, epilogue: str | None = "relu", dtype: str = "float32") -> "Task":
        return Task.make("dense", dtype, M=M, N=N, K=K, epilogue=epilogue)

    @staticmethod
    def softmax(M: int, N: int, dtype: str = "float32") -> "Task":
        return Task.make("softmax", dtype, M=M, N=N)

    @staticmethod
    def layernorm(M: int, N: int, eps: float = 1e-5, dtype: str = "float32") -> "Task":
        return Task.make("layernorm", dtype, M=M, N=N, eps=eps)

    @staticmethod
    def conv2d(N: int, H: int, W: int, CI: int, CO: int, KH: int, KW: int, stride: int = 1, pad: int = 0,
               dtype: str = "float32") -> "Task":
        return Task.make("conv2d", dtype, N=N, H=H, W=W, CI=CI, CO=CO, KH=KH, KW=KW, stride=stride, pad=pad)

    @staticmethod
    def from_op(primitive: str, in_shapes: list[tuple[int, ...]], dtype: str = "float32", **params) -> "Task":
        """Build a task from a primitive name and its (local, per-shard) input shapes.

        Primitives: dot_general/matmul ([M,K],[K,N]), batch_matmul ([B,M,K],[B,K,N]),
        dense ([M,K],[K,N],[N]; epilogue=...), softmax ([M,N]), layernorm ([M,N], ...),
        conv/conv_general_dilated/conv2d ([N,H,W,CI],[KH,KW,CI,CO]; stride=, pad=), NHWC.
        """
        shapes = [tuple(int(d) for d in s) for s in in_shapes]
        prim = {"dot_general": "matmul", "conv_general_dilated": "conv2d", "conv": "conv2d"}.get(primitive, primitive)

        def need(n):
            if len(shapes) < n:
                raise ValueError(f"{primitive}: expected {n} input shapes, got {shapes}")

        if prim == "matmul":
            need(2)
            (M, K), (K2, N) = shapes[0][-2:], shapes[1][-2:]
            if len(shapes[0]) == 3 and len(shapes[1]) == 3:
                prim = "batch_matmul"
            elif len(shapes[0]) != 2 or len(shapes[1]) != 2:
                raise ValueError(f"{primitive}: expected 2-D operands [M,K],[K,N] or 3-D batched, got {shapes}")
        if prim in ("matmul", "batch_matmul", "dense"):
            need(2)
            (M, K), (K2, N) = shapes[0][-2:], shapes[1][-2:]
            if K != K2:
                raise ValueError(f"{primitive}: contracting dims differ: {shapes[0]} @ {shapes[1]}")
            if prim == "batch_matmul":
                if shapes[0][0] != shapes[1][0]:
                    raise ValueError(f"{primitive}: batch dims differ: {shapes[0]} vs {shapes[1]}")
                return Task.batch_matmul(shapes[0][0], M, N, K, dtype)
            if prim == "dense":
                return Task.dense(M, N, K, params.get("epilogue", "relu"), dtype)
            return Task.matmul(M, N, K, dtype, params.get("epilogue"))
        if prim in ("softmax", "layernorm"):
            need(1)
            if len(shapes[0]) < 2:
                raise ValueError(f"{primitive}: expected an input of rank >= 2, got {shapes[0]}")
            M = int(np.prod(shapes[0][:-1]))
            N = shapes[0][-1]
            return Task.softmax(M, N, dtype) if prim == "softmax" else Task.layernorm(M, N, params.get("eps", 1e-5), dtype)
        if prim == "conv2d":
            need(2)
            (N, H, W, CI), (KH, KW, CI2, CO) = shapes[0], shapes[1]
            if CI != CI2:
                raise ValueError(f"{primitive}: input channels {CI} != kernel channels {CI2} (NHWC / HWIO layout)")
            return Task.conv2d(N, H, W, CI, CO, KH, KW, params.get("stride", 1), params.get("pad", 0), dtype)
        raise ValueError(f"unsupported primitive {primitive!r}; supported: dot_general, matmul, batch_matmul, "
                         f"dense, softmax, layernorm, conv2d")

    # ---- identity and serialisation ----
    @property
    def workload_key(self) -> str:
        """Stable key: op name, sorted parameters and dtype, e.g. `matmul(K=512,M=512,N=512)/float32`."""
        return f"{self.op}({','.join(f'{k}={v}' for k, v in self.params)})/{self.dtype}"

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "params": dict(self.params), "dtype": self.dtype}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Task":
        return Task(d["op"], tuple(sorted(d["params"].items())), d.get("dtype", "float32"))

    def __str__(self) -> str:
        return self.workload_key

    # ---- data ----
    @property
    def flops(self) -> int:
        return self.dag.flops()

    @property
    def input_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(self.dag.inputs)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.dag.shape_of(self.dag.output)

    def random_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {n: rng.standard_normal(s).astype(self.dtype) for n, s in self.dag.inputs}

    def reference(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """Independent numpy implementation (float64) of the operator."""
        ins64 = {k: v.astype(np.float64) for k, v in inputs.items()}
        return np.asarray(_OPS[self.op][1](ins64, **dict(self.params))).reshape(self.output_shape)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)
