"""Op graph: trace a function into flat primitive ops."""
from autopar.graph.op_graph import Op, OpGraph, TensorSpec

__all__ = ["Op", "OpGraph", "TensorSpec"]
