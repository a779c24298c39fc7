"""The op graph autopar plans on; it lives in `rockmate.graph` (the lower package) and is re-exported here."""
from rockmate.graph import Op, OpGraph, TensorSpec, call_graph, eval_graph, graph_from_jaxpr, trace_graph

__all__ = ["Op", "OpGraph", "TensorSpec", "call_graph", "eval_graph", "graph_from_jaxpr", "trace_graph"]
