"""The single-process greedy decode loop over a decode-step bundle: the oracle for generation.

    from tvmpipe.executor.decode_loop import greedy_decode
    r = greedy_decode("B", [5, 17, 3], max_new_tokens=8)   # r.tokens: the generated ids
    r.logits[i]                                            # [batch, vocab] logits of step i

The bundle declares its state pairs and a `generation` section (docs/bundle-format.md, version 2).
The prompt goes in token by token through the decode step (position 0, 1, ...), or up to C tokens a
step through a step compiled with `--chunk C` (chunked prefill); after the last prompt token each step's argmax over the logits is the next token, fed back at the next position.
State outputs become the next step's state inputs; each starts filled with its `init.fill`.
Everything runs in one `GraphRunner` on one backend (the reference NumPy backend by default).

A paged step (`--kv paged`, docs/paged-kv.md) takes a page table each step. The loop's rows move in
lockstep (the same length at every step), so it needs no allocator: `LockstepPages` gives row r its
k-th page `k * B + r`, pages taken in the order the rows reach them, so any pool that holds the
batch's tokens holds them; a chunk's tokens go in packed by `q_indptr`, n a row. (The scheduler's
`generation.pages.PagePool` is the general allocator, with prefix reuse and preemption; the
executor layer cannot import it, and this loop needs neither.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.decode_layout import step_rows
from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.bundle.state import PagedSpec
from tvmpipe.executor.errors import InputError
from tvmpipe.executor.paged_attention import position_map
from tvmpipe.executor.runner import GraphRunner


@dataclass
class DecodeResult:
    """`prompts` and `tokens` (generated ids) per sequence of the batch; `logits[i]` is step i's
    [batch, vocab] logits (one step per prompt token, or per chunk of them, then one per generated
    token but the last)."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    logits: list[np.ndarray] = field(default_factory=list)

    @property
    def sequences(self) -> list[list[int]]:
        return [p + t for p, t in zip(self.prompts, self.tokens)]


@dataclass(frozen=True)
class LockstepPages:
    """The page table of `rows` rows that always hold the same number of tokens, in a pool of
    `pages` pages of `page_size`: row r's k-th page is `k * rows + r`, so a length of L tokens uses
    the first `rows * ceil(L / page_size)` pages of the pool, whatever its size."""

    rows: int
    page_size: int
    pages: int
    capacity: int  # the step's page_table_values length

    def inputs(self, spec: PagedSpec, start: int, count: int, chunk: int) -> dict[str, np.ndarray]:
        """A step's paged inputs (int32, by input name) when every row writes tokens
        [start, start + count): the table of each row's pages holding start + count tokens, the
        append's position of each token (row b's at slots b*count .. in a chunked step, packed; at
        slot b in a one-token step; spare slots -1), and q_indptr for a chunked step."""
        length = start + count
        per_row = -(-length // self.page_size)
        if self.rows * per_row > self.pages:
            raise InputError(f"{self.rows} row(s) of {length} tokens need {self.rows * per_row} pages of "
                             f"{self.page_size}; the bundle's pool holds {self.pages} (--kv-pages)")
        indptr = np.arange(self.rows + 1, dtype=np.int32) * per_row
        values = np.zeros(self.capacity, np.int32)
        values[:self.rows * per_row] = (np.arange(per_row)[None, :] * self.rows
                                        + np.arange(self.rows)[:, None]).reshape(-1)
        last = np.full(self.rows, length - (per_row - 1) * self.page_size, np.int32)
        slots = np.full(self.rows * chunk, -1, np.int32)
        for b in range(self.rows):
            slots[b * count:(b + 1) * count] = position_map(indptr, values, self.page_size, b, start, count)
        out = {spec.indptr: indptr, spec.values: values, spec.last_page_len: last, spec.position_map: slots}
        if spec.q_indptr is not None:
            out[spec.q_indptr] = np.arange(self.rows + 1, dtype=np.int32) * count
        return out


class DecodeLoop:
    """One GraphRunner and the state of one micro-batch of sequences, stepped by hand:

        loop = DecodeLoop(bundle); logits = loop.step(token_ids)   # [batch] ids -> [batch, vocab]

    A step compiled with `--chunk C` also takes [batch, n] ids, n <= C (`chunk`), at positions
    position .. position + n - 1, and returns the last one's logits. A paged step's page table is
    `LockstepPages`'s (`pages`; None for a static step).
    """

    def __init__(self, bundle: Bundle | str | Path, backend: str = "reference", runner: GraphRunner | None = None,
                 **opts: Any) -> None:
        self.runner = runner or GraphRunner(bundle, backend, **opts)
        b = self.runner.bundle
        if b.generation is None:
            raise InputError(f"{b.path}: the bundle declares no generation section: it is not a decode step "
                             "(compile one with tvmpipe compile MODEL --decode)")
        self.bundle, self.gen = b, b.generation
        g = b.graph
        self._token = g.entry_of(self.gen.token)
        self.batch, self.chunk = step_rows(b)  # rows, and tokens a row a step can take
        self._position = g.entry_of(self.gen.position)
        self._count = g.entry_of(self.gen.count) if self.gen.count is not None else None
        paged = self.gen.paged
        self.pages = None if paged is None else LockstepPages(self.batch, paged.page_size, paged.pages,
                                                              g.entry_of(paged.values).shape[0])
        self.reset()

    def reset(self) -> None:
        """Every state back to its initial fill; position 0."""
        g = self.bundle.graph
        self.state = {p.input: np.full(g.entry_of(p.input).shape, p.fill, dtype=np_dtype(g.entry_of(p.input).dtype))
                      for p in self.bundle.state}
        self.position = 0

    def step(self, tokens: Sequence[int] | Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
        """Feed one token per sequence ([batch] ids), or n of them ([batch, n], n <= chunk), at the
        current position; the last one's logits [batch, vocab]."""
        ids = np.asarray(tokens)
        ids = ids.reshape(-1, 1) if ids.ndim <= 1 else ids
        if ids.ndim != 2 or ids.shape[0] != self.batch:
            raise InputError(f"{ids.shape[0] if ids.ndim == 2 else ids.size} row(s) of tokens for a batch of {self.batch}")
        n = ids.shape[1]
        if not 1 <= n <= self.chunk:
            raise InputError(f"{n} token(s) a row in one step; this step takes 1"
                             + (f" to {self.chunk} (compiled with --chunk {self.chunk})" if self.chunk > 1 else ""))
        if self.position + n > self.gen.max_context:
            raise InputError(f"the sequence is full: the bundle's max context is {self.gen.max_context} tokens")
        if ids.min() < 0 or ids.max() >= self.gen.vocab_size:
            raise InputError(f"token id {int(ids.max() if ids.max() >= self.gen.vocab_size else ids.min())} is "
                             f"outside the vocabulary (0..{self.gen.vocab_size - 1})")
        padded = np.zeros((self.batch, self.chunk), dtype=np_dtype(self._token.dtype))
        if self.pages is not None and self.chunk > 1:
            padded.reshape(-1)[:self.batch * n] = ids.reshape(-1)  # packed: row b's n tokens at b*n ..
        else:
            padded[:, :n] = ids
        feeds = {self.gen.token: padded.reshape(self._token.shape),
                 self.gen.position: np.full(self._position.shape, self.position, np_dtype(self._position.dtype)),
                 **self.state}
        if self.pages is not None:
            feeds.update(self.pages.inputs(self.gen.paged, self.position, n, self.chunk))
        if self._count is not None:
            feeds[self.gen.count] = np.full(self._count.shape, n, np_dtype(self._count.dtype))
        self.runner.run(**feeds)
        for p in self.bundle.state:
            self.state[p.input] = self.runner.get_output(p.output)
        self.position += n
        logits = self.runner.get_output(self.gen.logits)
        return logits.reshape(self.batch, -1, logits.shape[-1])[:, -1, :]


def greedy_decode(bundle: Bundle | str | Path, prompt: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int,
                  *, stop_tokens: Sequence[int] = (), backend: str = "reference", **opts: Any) -> DecodeResult:
    """Greedy generation over a decode-step bundle, one GraphRunner, no cache leaving the process.

    `prompt` is a list of ids (batch 1) or one list per sequence of the bundle's batch, all of the
    same length. A sequence stops at a stop token (kept) or after `max_new_tokens`; with a batch,
    finished sequences keep stepping (their tokens are not recorded) until all have stopped."""
    loop = DecodeLoop(bundle, backend, **opts)
    prompts = [list(map(int, p)) for p in prompt] if prompt and isinstance(prompt[0], (list, tuple, np.ndarray)) \
        else [list(map(int, prompt))]
    if len(prompts) != loop.batch:
        raise InputError(f"{len(prompts)} prompt(s) for a bundle of batch {loop.batch}")
    n = len(prompts[0])
    if n == 0 or any(len(p) != n for p in prompts):
        raise InputError("prompts must be non-empty and, in one batch, of the same length")
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if n + max(max_new_tokens - 1, 0) > loop.gen.max_context:
        raise InputError(f"a prompt of {n} tokens and {max_new_tokens} new ones need {n + max_new_tokens - 1} "
                         f"cache positions; the bundle's max context is {loop.gen.max_context}")
    result = DecodeResult(prompts, [[] for _ in prompts])
    if max_new_tokens == 0:
        return result
    logits = None
    for i in range(0, n, loop.chunk):  # a token a step, or a chunk of them
        logits = loop.step([p[i:i + loop.chunk] for p in prompts])
        result.logits.append(logits)
    stops, done = set(stop_tokens), [False] * loop.batch
    while True:
        nxt = np.argmax(logits, axis=-1)
        for s, t in enumerate(nxt):
            if not done[s]:
                result.tokens[s].append(int(t))
                done[s] = int(t) in stops or len(result.tokens[s]) >= max_new_tokens
        if all(done):
            return result
        logits = loop.step(nxt)
        result.logits.append(logits)
