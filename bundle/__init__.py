"""The bundle layer: graph.json and tvmpipe bundles. It imports nothing from the other layers."""

from tvmpipe.bundle.bundle import Bundle, Manifest, defined_kernels, load_bundle, write_bundle
from tvmpipe.bundle.errors import BundleError, GraphError, Problem, ProblemCollector, ProblemsError
from tvmpipe.core.errors import TvmpipeError
from tvmpipe.bundle.graph import Entry, EntryRef, Graph, Node
from tvmpipe.bundle.graph_reader import parse_graph, parse_graph_text, read_graph
from tvmpipe.bundle.manifests import FusedFunction, KernelFunction, Launch, Operand, OpRecord, Ref, Workspace

__all__ = [
    "Bundle", "Manifest", "defined_kernels", "load_bundle", "write_bundle",
    "BundleError", "GraphError", "Problem", "ProblemCollector", "ProblemsError", "TvmpipeError",
    "Entry", "EntryRef", "Graph", "Node", "parse_graph", "parse_graph_text", "read_graph",
    "FusedFunction", "KernelFunction", "Launch", "Operand", "OpRecord", "Ref", "Workspace",
]
