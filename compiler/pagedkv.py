"""TVM's paged-KV kernels (decode and chunk attention over a page table, and the append by position
map) in tvmpipe's launch form: static shapes, a flat list of CUDA launches, one CUDA translation unit.

The kernels are TVM 0.27's own TIR generators in `tvm.relax.frontend.nn.llm` (plain TIR, no
FlashInfer): `_attention_decode` (`batch_decode_paged_kv`: one query a row), `_attention_prefill`
(`batch_prefill_paged_kv`: a chunk of queries a row, causal, packed by `q_indptr`) and
`_kv_cache_transpose_append` (`tir_kv_cache_transpose_append`). `_attention_decode_cpu` and
`_attention_prefill_cpu` are the llvm variants that the tests run on a machine without a GPU
(tests/compiler/test_pagedkv.py, against executor/paged_attention.py). Each of the three is one
kernel launch with no workspace (the prefill kernel's grid is a fixed number of blocks per KV
head that walk the rows' query tiles).

What had to change for a flat launch list (compiler/launches.py):
- **Symbolic shapes.** The generators take every size that a runtime cache varies as a symbolic
  variable: the rows `B`, the page pool `max_num_pages`, the page table's length `nnz_pages`, the
  append's token count `ntoken`, and each buffer's `elem_offset`. A launch list's grid must be a
  number, and a symbolic `elem_offset` becomes a kernel argument computed from the DLTensor at run
  time, which a flat list cannot pass. tvmpipe's steps are static anyway (rows = batch x slots, the
  pool sized once per stage), so `specialize_static` replaces each buffer parameter by a buffer of
  the step's static shape with offset 0 (`PrimFunc.specialize`). The order matters:
  `page_table_indptr` is `(B + 1,)`, which specialize cannot bind by itself; once a buffer of shape
  `(B, ...)` has bound `B` it is a constant and matches. The page table's length is a capacity
  (`PagedShape.table_capacity`): entries past `indptr[B]` are never read; so is the chunk's query
  count (`tokens`): query slots past `q_indptr[B]` are not computed.
- **Scalar parameters.** `rotary_mode`, `rope_scale`, `rope_theta`, `sm_scale` (and the chunk's
  `causal`, 1) are kernel arguments taken from the host call; a flat launch list has no host values
  to pass, so they are specialized to constants. `rotary_mode` is 0: tvmpipe's decode step applies rotary itself before
  the attention (compiler/decoders.py), and K is stored in the pages already rotated, so the kernel
  must not rotate again. With it 0 the kernel no longer reads `k_rope_pos_offset` and
  `q_rope_position`; the launch does not pass them (the host code read by launches.py says which
  function arguments each kernel takes).
- **Schedules.** The attention kernels come scheduled (thread bindings, `tirx.is_scheduled`); the
  append is a plain loop nest and gets dlight's `gpu.Fallback`, as TVM's own test does.

`lse` (an output of the attention kernels, [rows or queries, H_qo] float32) is in log2 units (the kernel works with
`exp2`): log2 of the softmax denominator of the scaled scores. It is what `merge_state_inplace`
combines; the decode step itself only reads `output`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tvmpipe.bundle.manifests import KernelFunction
from tvmpipe.compiler.errors import CompileError

DECODE = "paged_decode"
PREFILL = "paged_prefill"
APPEND = "paged_append"


PAGE_DTYPES = ("float32", "float16")


def check_page_dtype(dtype: str) -> None:
    """Pages are built in float32 and float16 only (the dtypes the kernels are checked in against
    the oracle, docs/paged-kv.md): a step of another dtype (bfloat16) is refused in one line."""
    if dtype not in PAGE_DTYPES:
        raise CompileError(f"--kv paged: pages of {dtype} are not built (float32 and float16 are); use --kv static")


@dataclass(frozen=True)
class PagedShape:
    """The static sizes one decode step's paged kernels are built for.

    `rows` is the step's rows (its batch), `tokens` the token slots a step writes (rows x chunk),
    `num_pages` the stage's pool, `table_capacity` the length of the CSR page-table values array
    (at most every row's pages: rows x ceil(max_context / page_size))."""

    num_kv_heads: int
    num_qo_heads: int
    head_dim: int
    dtype: str
    page_size: int
    rows: int
    num_pages: int
    table_capacity: int
    tokens: int

    def __post_init__(self) -> None:
        if self.num_qo_heads % self.num_kv_heads:
            raise CompileError(f"{self.num_qo_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        check_page_dtype(self.dtype)
        for name in ("page_size", "rows", "num_pages", "table_capacity", "tokens", "head_dim"):
            if getattr(self, name) < 1:
                raise CompileError(f"paged KV {name} {getattr(self, name)}: must be at least 1")

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def decode_args(self) -> list[tuple[str, tuple[int, ...], str]]:
        """The decode function's buffer arguments in order: (name, shape, dtype); a launch's
        Operand("arg", index) indexes this list."""
        b, hq, hkv, d = self.rows, self.num_qo_heads, self.num_kv_heads, self.head_dim
        return [("q", (b, hq, d), self.dtype), ("pages", self.pool_shape, self.dtype),
                ("page_table_indptr", (b + 1,), "int32"), ("page_table_values", (self.table_capacity,), "int32"),
                ("last_page_len", (b,), "int32"), ("k_rope_pos_offset", (b,), "int32"),
                ("q_rope_position", (b,), "int32"), ("output", (b, hq, d), self.dtype), ("lse", (b, hq), "float32")]

    def prefill_args(self) -> list[tuple[str, tuple[int, ...], str]]:
        """The chunk (prefill) function's buffer arguments in order: `tokens` queries packed by
        `q_indptr` (row b's are q[q_indptr[b]:q_indptr[b + 1]], the last tokens of its length)."""
        b, t, hq, d = self.rows, self.tokens, self.num_qo_heads, self.head_dim
        return [("q", (t, hq, d), self.dtype), ("q_indptr", (b + 1,), "int32"), ("pages", self.pool_shape, self.dtype),
                ("page_table_indptr", (b + 1,), "int32"), ("page_table_values", (self.table_capacity,), "int32"),
                ("last_page_len", (b,), "int32"), ("k_rope_pos_offset", (b,), "int32"),
                ("q_rope_position", (t,), "int32"), ("output", (t, hq, d), self.dtype), ("lse", (t, hq), "float32")]

    def append_args(self) -> list[tuple[str, tuple[int, ...], str]]:
        """The append function's buffer arguments in order (pages is written in place)."""
        t, hkv, d = self.tokens, self.num_kv_heads, self.head_dim
        return [("pages", self.pool_shape, self.dtype), ("k", (t, hkv, d), self.dtype),
                ("v", (t, hkv, d), self.dtype), ("position_map", (t,), "int32")]

    @property
    def pool_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_pages, 2, self.num_kv_heads, self.page_size, self.head_dim)


def specialize_static(func: Any, shapes: list[tuple[str, tuple[int, ...], str]],
                      scalars: dict[str, float | int] | None = None) -> Any:
    """`func` with every buffer parameter of static shape and offset 0, and its scalar parameters
    constants: the i-th buffer parameter takes `shapes[i]`, a scalar parameter `scalars[name]`.

    `PrimFunc.specialize` binds a buffer only where each dimension is a constant or a bare
    variable; a derived one (`(batch_size + 1,)`) must already be a constant, through an earlier
    binding of its variable. So the buffers are bound in passes, each taking those whose shapes
    are bindable now, until none is left. specialize itself checks each given shape against the
    parameter's (a mismatch raises)."""
    from tvm import tirx

    scalars = dict(scalars or {})
    buffer_names = [p.name for p in func.params if getattr(p, "shape", None) is not None and len(p.shape)]
    if len(buffer_names) != len(shapes):
        raise CompileError(f"internal: {len(buffer_names)} buffer parameters, {len(shapes)} shapes given")
    pending = dict(zip(buffer_names, shapes))

    def param(name: str) -> Any:
        return next(p for p in func.params if p.name == name)

    def bindable(dim: Any) -> bool:
        return isinstance(dim, (tirx.IntImm, tirx.Var))

    while pending:
        ready = [n for n in pending if all(bindable(d) for d in param(n).shape)]
        if not ready:
            raise CompileError(f"internal: the shapes of {sorted(pending)} derive from variables no buffer binds")
        for name in ready:
            p = param(name)
            _, dims, dtype = pending.pop(name)
            if len(dims) != len(p.shape) or str(p.dtype) != dtype:
                raise CompileError(f"internal: {name} is {p.dtype}{list(p.shape)}, given {dtype}{list(dims)}")
            static = [d if isinstance(d, tirx.IntImm) and int(d) == n else tirx.IntImm(str(d.ty), n)
                      for d, n in zip(p.shape, dims)]
            func = func.specialize({p: tirx.decl_buffer(static, dtype, name)})
    for p in [p for p in func.params if p.name not in buffer_names]:
        if p.name not in scalars:
            raise CompileError(f"internal: no value for scalar parameter {p.name}")
        value = scalars.pop(p.name)
        dt = str(p.ty.dtype)
        func = func.specialize({p: tirx.FloatImm(dt, float(value)) if "float" in dt else tirx.IntImm(dt, int(value))})
    if scalars:
        raise CompileError(f"internal: {sorted(scalars)} are not parameters of the function")
    return func


def decode_scalars(shape: PagedShape) -> dict[str, float | int]:
    """The decode kernel's scalar parameters: no rotary inside the kernel (the step applies it)."""
    return {"rotary_mode": 0, "rope_scale": 1.0, "rope_theta": 10000.0, "sm_scale": shape.sm_scale}


CUDA_MAX_BLOCK_Z = 64


def decode_thread_limit(shape: PagedShape) -> int | None:
    """The thread limit that keeps the decode kernel's block within CUDA's z limit, or None when
    its own (512) does. TVM's generator fills a block of min(512, the target's limit) threads with
    bdz = limit / (bdx * bdy), bdx = head_dim / vec: at a small head_dim (16, the tiny test
    decoders') bdz would be 128, over CUDA's 64. A smaller limit gives the same kernel with fewer
    z threads."""
    vec = min(max(8 // 2, shape.head_dim // 32), 4)  # the generator takes 2-byte elements whatever the dtype
    bdx, bdy = shape.head_dim // vec, shape.num_qo_heads // shape.num_kv_heads
    while bdx * bdy > 512 and bdy > 1:
        bdy //= 2
    if 512 // (bdx * bdy) <= CUDA_MAX_BLOCK_Z:
        return None
    return CUDA_MAX_BLOCK_Z * bdx * bdy


def _limited(target: Any, threads: int | None) -> Any:
    """`target` with at most `threads` threads a block (None: as it is)."""
    if threads is None:
        return target
    import tvm

    attrs = dict(target.export())
    attrs["max_num_threads"] = attrs["max_threads_per_block"] = threads
    return tvm.target.Target(attrs)


def decode_func(shape: PagedShape, target: Any) -> Any:
    """`batch_decode_paged_kv` for `target` (scheduled by its generator), static."""
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

    f = _attention_decode(shape.num_kv_heads, shape.num_qo_heads, shape.head_dim, shape.dtype, False, {},
                          _limited(target, decode_thread_limit(shape)), shape.page_size)
    return specialize_static(f, shape.decode_args(), decode_scalars(shape))


def decode_func_cpu(shape: PagedShape) -> Any:
    """The llvm variant (`_attention_decode_cpu`), static the same way: what the tests run here."""
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu

    f = _attention_decode_cpu(shape.num_kv_heads, shape.num_qo_heads, shape.head_dim, shape.dtype, False, {},
                              shape.page_size)
    return specialize_static(f, shape.decode_args(), decode_scalars(shape))


def prefill_scalars(shape: PagedShape) -> dict[str, float | int]:
    """The chunk kernel's scalars: causal (query j of a row's n sees its first length - n + j + 1
    tokens), no rotary."""
    return {"causal": 1, **decode_scalars(shape)}


def prefill_func(shape: PagedShape, target: Any) -> Any:
    """`batch_prefill_paged_kv` for `target` (scheduled by its generator), static: a chunked step's
    attention (several new tokens a row) over the pages."""
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill

    f = _attention_prefill(shape.num_kv_heads, shape.num_qo_heads, shape.head_dim, shape.dtype, False, {}, target,
                           shape.page_size)
    return specialize_static(f, shape.prefill_args(), prefill_scalars(shape))


def prefill_func_cpu(shape: PagedShape) -> Any:
    """The llvm variant (`_attention_prefill_cpu`), static the same way."""
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_cpu

    f = _attention_prefill_cpu(shape.num_kv_heads, shape.num_qo_heads, shape.head_dim, shape.dtype, False, {},
                               shape.page_size)
    return specialize_static(f, shape.prefill_args(), prefill_scalars(shape))


def append_func(shape: PagedShape) -> Any:
    """`tir_kv_cache_transpose_append`, static and unscheduled (it runs as is on llvm)."""
    from tvm.relax.frontend.nn.llm._page_kernels import _kv_cache_transpose_append

    f = _kv_cache_transpose_append(shape.num_kv_heads, shape.head_dim, shape.dtype, shape.page_size)
    return specialize_static(f, shape.append_args())


def shape_of_call(op: str, shapes: list[list[int]] | list[tuple[int, ...]], dtype: str) -> PagedShape:
    """The PagedShape of a step's call of paged op `op` (`paged_append`, `paged_decode` or
    `paged_prefill`) from its tensor arguments' shapes, in order (an ops.json record's input
    shapes, or the Relax call's), with pages of `dtype`."""
    if op == APPEND:
        pages, k = shapes[0], shapes[1]
        rows, tokens, capacity, hq = 1, k[0], 1, pages[2]
    elif op == DECODE:
        q, pages, values = shapes[0], shapes[1], shapes[3]
        rows, tokens, capacity, hq = q[0], q[0], values[0], q[1]
    elif op == PREFILL:
        q, q_indptr, pages, values = shapes[0], shapes[1], shapes[2], shapes[4]
        rows, tokens, capacity, hq = q_indptr[0] - 1, q[0], values[0], q[1]
    else:
        raise CompileError(f"internal: '{op}' is not a paged op")
    return PagedShape(num_kv_heads=pages[2], num_qo_heads=hq, head_dim=pages[4], dtype=dtype, page_size=pages[3],
                      rows=rows, num_pages=pages[0], table_capacity=capacity, tokens=tokens)


def step_func(op: str, shape: PagedShape, target: Any | None) -> Any:
    """The PrimFunc a decode step calls for paged op `op`: for a CUDA `target` the kernel as it is
    launched (the attention scheduled by its generator, the append by dlight's gpu.Fallback), for
    None its llvm variant."""
    if op == APPEND:
        func = append_func(shape)
        if target is None:
            return func
        import tvm
        import tvm.s_tir.dlight as dl

        with target:
            return dl.ApplyDefaultSchedule(dl.gpu.Fallback())(tvm.IRModule({APPEND: func}))[APPEND]
    if op == DECODE:
        return decode_func(shape, target) if target is not None else decode_func_cpu(shape)
    if op == PREFILL:
        return prefill_func(shape, target) if target is not None else prefill_func_cpu(shape)
    raise CompileError(f"internal: '{op}' is not a paged op")


def cpu_func(op: str, shapes: list[list[int]], dtypes: list[str]) -> Any:
    """The llvm variant of a compiled step's paged function, from its ops.json record's input
    shapes and dtypes (op `paged_append`, `paged_decode` or `paged_prefill`): what the compiler's
    CPU check (compiler/cpucheck.py) builds in place of the CUDA-scheduled one, with the same
    parameters."""
    return step_func(op, shape_of_call(op, shapes, dtypes[0]), None)


@dataclass
class PagedKernels:
    """The paged kernels of one PagedShape in launch form: `functions[DECODE]` and
    `functions[APPEND]` (launches whose Operand("arg", i) index `args[name][i]`), the CUDA source
    of every kernel they launch, and the shape they were built for."""

    shape: PagedShape
    functions: dict[str, KernelFunction]
    args: dict[str, list[tuple[str, tuple[int, ...], str]]]
    cuda_source: str

    def launch_count(self) -> dict[str, int]:
        return {name: len(kf.launches) for name, kf in self.functions.items()}


def build_paged_kernels(shape: PagedShape, arch: str = "sm_90") -> PagedKernels:
    """Specialize, schedule (append: dlight gpu.Fallback) and lower the three kernels for CUDA `arch`."""
    from tvmpipe.compiler import launches

    launches.check_arch(arch)
    target = launches.cuda_target(arch)
    funcs = {op: step_func(op, shape, target) for op in (DECODE, PREFILL, APPEND)}
    lowered = {name: launches.lower_function(name, f, target) for name, f in funcs.items()}
    device = {sym: f for low in lowered.values() for sym, f in low.device_funcs.items()}
    return PagedKernels(shape=shape, functions={n: low.kernels for n, low in lowered.items()},
                        args={DECODE: shape.decode_args(), PREFILL: shape.prefill_args(), APPEND: shape.append_args()},
                        cuda_source=launches.cuda_source(device, target))
