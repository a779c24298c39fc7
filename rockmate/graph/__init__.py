"""The op graph, the one IR of autopar and rockmate: a traced function as flat primitive ops."""
from rockmate.graph.evaluate import call_graph, eval_graph, eval_ops
from rockmate.graph.op_graph import Op, OpGraph, TensorSpec
from rockmate.graph.trace import graph_from_jaxpr, trace_graph

__all__ = ["Op", "OpGraph", "TensorSpec", "call_graph", "eval_graph", "eval_ops", "graph_from_jaxpr", "trace_graph"]
