"""How many pages a paged decode step's pool gets at run time (issue 53, `--kv-tokens`).

A paged step (docs/paged-kv.md) holds one page pool per layer, the same page count on every stage
(one page table for the pipeline). Its size is a run-time choice (bundle/pool.py resizes the
bundle's pool entries), made here once for the whole pipeline:

* **Asked for** (`--kv-tokens N`): ceil(N / page size) pages. Refused, in one line naming the
  field, when it holds less than one row at the max context (bundle.state.pool_shortfall, the
  load's own check) or when it does not fit in the stages' memory (below): never an OOM later.
* **The default**: rows x max context tokens, the most any mix of sequences on the step's rows
  can ever hold (a pool that big never makes a row wait or be preempted; more would only cache
  prefixes), reduced to what fits in `fraction` (0.9, as vLLM's gpu_memory_utilization) of the
  free memory of the tightest memory the stages use, after what each stage holds besides the pool
  (its weights and activations: its storage plan); never below one row at the max context (else a
  one-line error). Rows stay a concurrency limit only: with the pool smaller than rows x max
  context the scheduler admits by pages and preempts when they run out.

Stages that share a memory (every reference-backend stage on this host, cuda stages on one GPU)
share its free bytes: the pool is sized against the sum of what they hold, not each alone. Free
memory is read once, before the stages start, by `free_memory` (the lowest boundary: MemAvailable
for host memory, cuMemGetInfo for a GPU); where it cannot be read (a remote node) the memory does
not limit the default, and each stage still refuses at start, in one line, a pool that does not
fit (executor/stage.py SlotState.check_fits).

A page costs a stage its layers' pools' bytes once: a stage keeping the pools resident plans them no
storage slot of its own (executor/program.py `resident_state`), the state buffer the kernels are
pointed at being the only copy; `stage_memory` reads the same program a stage builds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.pool import pages_for
from tvmpipe.bundle.state import PagedSpec, pool_shortfall
from tvmpipe.core.errors import FieldError, TvmpipeError
from tvmpipe.core.units import format_bytes
from tvmpipe.executor.program import build_stage_program

AUTO = "auto"  # kv_tokens: the default from the stages' free memory
DEFAULT_FRACTION = 0.9  # of a memory's free bytes the stages on it may take (vLLM's gpu_memory_utilization)
FIELD = "kv_tokens"  # the FieldError field: each front end names it (`--kv-tokens`)
HOST = "host"


@dataclass(frozen=True)
class StageMemory:
    """What one stage holds in `memory` ("host", or "cuda:N"): `fixed_bytes` whatever the pool
    (weights, activations: its storage plan), `page_bytes` what each page of the pool adds (a page
    of each of its layers' pools, resident)."""

    stage: int
    memory: str
    fixed_bytes: int
    page_bytes: int


@dataclass(frozen=True)
class PoolSize:
    """The pool a run gets: `pages` of `page_size` tokens on every stage, and how it was chosen:
    `requested` tokens (None: the default), `cap_pages` (rows x max context), `fit_pages` (what the
    tightest memory holds; None: not read), `limit` (that memory, or None)."""

    pages: int
    page_size: int
    requested: int | None
    cap_pages: int
    fit_pages: int | None
    limit: str | None

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size


def paged_spec(bundle: Bundle) -> PagedSpec:
    """The bundle's paged spec, or a FieldError: only a paged step has a pool to size."""
    gen = bundle.generation
    if gen is None or gen.paged is None:
        raise FieldError(FIELD, "sizes a paged KV pool, and this bundle's decode step keeps static caches "
                                "(compile it with --kv paged)")
    return gen.paged


def requested_pages(bundle: Bundle, tokens: int) -> int:
    """Pages for `tokens` asked for; a FieldError where the bundle is not paged, or the pool would
    hold less than one row at the max context (the load's check, bundle.state.pool_shortfall).
    Checked before anything starts; the memory is checked by `size_pool`."""
    paged = paged_spec(bundle)
    if tokens < 1:
        raise FieldError(FIELD, f"must be a positive number of tokens, got {tokens}")
    pages = pages_for(tokens, paged.page_size)
    short = pool_shortfall(dataclasses.replace(paged, pages=pages), bundle.generation.max_context)
    if short is not None:
        raise FieldError(FIELD, f"{tokens}: {short}")
    return pages


def stage_memory(bundle: Bundle, stages: Sequence[tuple[int, int]], memories: Sequence[str]) -> list[StageMemory]:
    """Each stage's bytes besides the pool and per page, from its program as a stage keeping its
    state resident builds it (the storage plan every backend allocates) and its state pairs, at the
    bundle's compiled pool."""
    paged = paged_spec(bundle)
    stage_inputs = {bundle.graph.entry_id(bundle.graph.node_index[p.input]) for p in bundle.state if p.scope == "stage"}
    out = []
    for i, ((start, end), memory) in enumerate(zip(stages, memories)):
        # resident, the pools take no bytes of the plan: it is all the stage holds besides them
        program = build_stage_program(bundle, start, end, resident_state=True)
        pool_bytes = sum(program.entry_specs[e].nbytes for e in program.input_entries.values() if e in stage_inputs)
        out.append(StageMemory(i, memory, program.storage.total_bytes(), -(-pool_bytes // paged.pages)))
    return out


def fit_pages(needs: Sequence[StageMemory], read: Callable[[str], int | None],
              fraction: float = DEFAULT_FRACTION) -> tuple[int | None, str | None, str]:
    """(pages, memory, why): the most pages every memory holds in `fraction` of its free bytes
    after what its stages hold besides the pool, the memory that limits it, and a phrase saying
    so; (None, None, "") where no memory could be read."""
    best: tuple[int | None, str | None, str] = (None, None, "")
    for memory in dict.fromkeys(n.memory for n in needs):
        on = [n for n in needs if n.memory == memory]
        free = read(memory)
        if free is None:
            continue
        fixed = sum(n.fixed_bytes for n in on)
        per_page = max(1, sum(n.page_bytes for n in on))
        pages = max(0, (int(fraction * free) - fixed) // per_page)
        if best[0] is None or pages < best[0]:
            why = (f"{memory} memory: {fraction:.0%} of its {format_bytes(free)} free, less "
                   f"{format_bytes(fixed)} of weights and activations of "
                   f"{len(on)} stage(s), at {format_bytes(per_page)} a page")
            best = (pages, memory, why)
    return best


def size_pool(bundle: Bundle, rows: int, needs: Sequence[StageMemory], kv_tokens: int | str | None,
              read: Callable[[str], int | None], fraction: float = DEFAULT_FRACTION) -> PoolSize:
    """The pool for `kv_tokens` (tokens asked for, or AUTO: the default; the module docstring says
    the rule) on a step of `rows` rows; a FieldError naming the field where it cannot be had."""
    paged = paged_spec(bundle)
    max_context = bundle.generation.max_context
    one_row = pages_for(max_context, paged.page_size)
    cap = rows * one_row
    fit, limit, why = fit_pages(needs, read, fraction)
    if kv_tokens != AUTO:
        if not isinstance(kv_tokens, int):
            raise TvmpipeError(f"internal: kv_tokens is {kv_tokens!r}, not a number of tokens or {AUTO!r}")
        pages = requested_pages(bundle, kv_tokens)
        if fit is not None and pages > fit:
            raise FieldError(FIELD, f"{kv_tokens}: {pages} pages of {paged.page_size} tokens do not fit; "
                                    f"{fit} pages ({fit * paged.page_size} tokens) do, in {why}")
        return PoolSize(pages, paged.page_size, kv_tokens, cap, fit, limit)
    pages = cap if fit is None else min(cap, fit)
    if pages < one_row:
        raise FieldError(FIELD, f"(default): only {pages} pages of {paged.page_size} tokens fit, less than one row "
                                f"at the max context ({max_context} tokens), in {why}; free memory or use more stages")
    return PoolSize(pages, paged.page_size, None, cap, fit, limit)


def free_memory(memory: str) -> int | None:
    """Free bytes of `memory` now: "host" (MemAvailable), "cuda:N" (cuMemGetInfo on device N);
    None where it cannot be read. The one place the sizing reads memory (tests fake it)."""
    if memory == HOST:
        return host_available()
    if memory.startswith("cuda:"):
        from tvmpipe.executor.backend_cuda import device_free_memory

        try:
            return device_free_memory(int(memory.split(":", 1)[1]))
        except TvmpipeError:
            return None
    return None


def host_available() -> int | None:
    """Host memory a process could still take (Linux MemAvailable), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
