"""Buffers a torch.export program mutates in place become state: a graph input, an output, a pair.

A module that keeps its KV cache in registered buffers and updates them with
`self.k_cache.copy_(...)` exports (after `run_decompositions()`) as a functional graph: each buffer
is a placeholder, and its new value is an extra output the graph signature lists as
`BUFFER_MUTATION`. TVM's importer binds the buffers as constants and drops the mutation outputs,
which compiled such a program into one whose caches never change. Here each mutated buffer is
lifted instead:

- its placeholder becomes a graph input (after the program's own inputs; named as torch.export
  named it, e.g. `b_layers_0_k_cache`);
- its new value becomes a graph output (after the program's own outputs);
- the bundle declares the pair (state name = the buffer's name in the module, e.g.
  `layers.0.k_cache`; `init.fill` = the buffer's value, which must be one constant: the format
  holds a fill, not a tensor, so a buffer with varying contents is refused in one line).

In-place updates of user inputs (`USER_INPUT_MUTATION`) are refused in one line too: the bundle
could not return them either.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from tvmpipe.compiler.errors import SourceError


@dataclass
class Lifted:
    program: Any  # _LiftedProgram: what TVM's importer reads
    pairs: list[tuple[str, str, int, float]]  # (buffer name, input name, output index, fill)


class _LiftedProgram:
    """The ExportedProgram as TVM's importer reads it, with the mutated buffers turned into user
    inputs and their new values into user outputs. Everything else is the program's own."""

    def __init__(self, ep: Any, signature: Any, graph_module: Any, lifted: set[str]) -> None:
        self._ep, self.graph_signature, self.graph_module, self._lifted = ep, signature, graph_module, lifted
        self.graph = graph_module.graph
        self.constants = {k: v for k, v in ep.constants.items() if k not in lifted}

    def named_buffers(self) -> Any:
        return ((n, b) for n, b in self._ep.named_buffers() if n not in self._lifted)

    def run_decompositions(self, *args: Any, **kwargs: Any) -> "_LiftedProgram":
        return self  # already decomposed before lifting

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ep, name)


def _fill(name: str, value: Any) -> float | None:
    """The buffer's one value, or None when it holds more than one."""
    flat = value.detach().reshape(-1)
    if flat.numel() == 0:
        return 0.0
    first = flat[0]
    return float(first) if bool((flat == first).all()) else None


def mutates(ep: Any) -> bool:
    """Whether the program's signature lists any output that is not the program's own."""
    from torch.export.graph_signature import OutputKind

    return any(s.kind not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT) for s in ep.graph_signature.output_specs)


def lift_mutated_buffers(ep: Any, model: str) -> Lifted | None:
    """None when `ep` (decomposed) mutates nothing; else the lifted program and its state pairs."""
    from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec,
                                              TensorArgument)

    sig = ep.graph_signature
    inputs_mutated = [s.target for s in sig.output_specs if s.kind == OutputKind.USER_INPUT_MUTATION]
    if inputs_mutated:
        raise SourceError(f"{model}: the program updates its input(s) {', '.join(inputs_mutated)} in place; a bundle "
                          "cannot return an updated input: return the new value as an output instead")
    mutations = [(i, s) for i, s in enumerate(sig.output_specs) if s.kind == OutputKind.BUFFER_MUTATION]
    if not mutations:
        return None
    buffers = dict(ep.named_buffers())
    targets = [s.target for _, s in mutations]
    fills = {t: _fill(t, buffers[t]) for t in targets}
    varying = [t for t in targets if fills[t] is None]
    if varying:
        raise SourceError(f"{model}: the program updates buffer(s) {', '.join(varying)} in place, and their initial "
                          "values are not one constant; bundle state starts from a fill value: register them with "
                          "torch.zeros/torch.full, or pass them as inputs and return their new values")
    lifted = set(targets)
    placeholder_of = {s.target: s.arg.name for s in sig.input_specs
                      if s.kind == InputKind.BUFFER and s.target in lifted}
    missing = [t for t in targets if t not in placeholder_of]
    if missing:
        raise SourceError(f"{model}: the program updates buffer(s) {', '.join(missing)} in place, but torch.export "
                          "lists no input for them; tvmpipe cannot lift them into state")

    user_in = [s for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    as_inputs = [InputSpec(InputKind.USER_INPUT, TensorArgument(placeholder_of[t]), None) for t in targets]
    rest_in = [s for s in sig.input_specs
               if s.kind != InputKind.USER_INPUT and not (s.kind == InputKind.BUFFER and s.target in lifted)]

    gm = copy.deepcopy(ep.graph_module)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    if len(outs) != len(sig.output_specs):
        raise SourceError(f"{model}: the program's graph has {len(outs)} outputs but its signature lists "
                          f"{len(sig.output_specs)}; tvmpipe cannot lift its mutated buffers")
    user_idx = [i for i, s in enumerate(sig.output_specs) if s.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT)]
    mut_idx = [i for i, _ in mutations]
    other = [sig.output_specs[i].kind.name for i in range(len(outs)) if i not in user_idx and i not in mut_idx]
    if other:
        raise SourceError(f"{model}: the program has outputs of kind {', '.join(sorted(set(other)))}, which a "
                          "bundle cannot express")
    order = user_idx + mut_idx
    out_node.args = (tuple(outs[i] for i in order),)
    gm.recompile()

    def as_user(spec: Any) -> Any:
        return OutputSpec(OutputKind.USER_OUTPUT, spec.arg, None)

    new_sig = ExportGraphSignature(user_in + as_inputs + rest_in, [as_user(sig.output_specs[i]) for i in order])
    pairs = [(t, placeholder_of[t], len(user_idx) + k, fills[t]) for k, t in enumerate(targets)]
    return Lifted(_LiftedProgram(ep, new_sig, gm, lifted), pairs)


def import_lifted(lifted: Lifted) -> tuple[Any, list[Any]]:
    """TVM's importer on the lifted program: (Relax module, state pairs)."""
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    from tvmpipe.bundle.state import StatePair

    mod = ExportedProgramImporter().from_exported_program(lifted.program, keep_params_as_input=True,
                                                          unwrap_unit_return_tuple=True, no_bind_return_tuple=False,
                                                          custom_convert_map=None)
    return mod, [StatePair(name, inp, out, fill) for name, inp, out, fill in lifted.pairs]
