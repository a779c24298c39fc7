"""Op graph: trace a function into flat primitive ops."""
from autopar.graph.evaluate import call_graph, eval_graph
from autopar.graph.op_graph import Op, OpGraph, TensorSpec
from autopar.graph.trace import graph_from_jaxpr, trace_graph

__all__ = ["Op", "OpGraph", "TensorSpec", "call_graph", "eval_graph", "graph_from_jaxpr", "trace_graph"]
