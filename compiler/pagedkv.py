"""TVM's paged-KV kernels (decode attention over a page table, and the append by position map) in
tvmpipe's launch form: static shapes, a flat list of CUDA launches, one CUDA translation unit.

The kernels are TVM 0.27's own TIR generators in `tvm.relax.frontend.nn.llm` (plain TIR, no
FlashInfer): `_attention_decode` (`batch_decode_paged_kv`) and `_kv_cache_transpose_append`
(`tir_kv_cache_transpose_append`); `_attention_decode_cpu` is the llvm variant that the tests run
on a machine without a GPU (tests/compiler/test_pagedkv.py, against executor/paged_attention.py).

What had to change for a flat launch list (compiler/launches.py):
- **Symbolic shapes.** Both generators take every size that a runtime cache varies as a symbolic
  variable: the rows `B`, the page pool `max_num_pages`, the page table's length `nnz_pages`, the
  append's token count `ntoken`, and each buffer's `elem_offset`. A launch list's grid must be a
  number, and a symbolic `elem_offset` becomes a kernel argument computed from the DLTensor at run
  time, which a flat list cannot pass. tvmpipe's steps are static anyway (rows = batch x slots, the
  pool sized once per stage), so `specialize_static` replaces each buffer parameter, in parameter
  order, by a buffer of the step's static shape with offset 0 (`PrimFunc.specialize`). The order
  matters: `page_table_indptr` is `(B + 1,)`, which specialize cannot bind by itself; once `Q` has
  bound `B` it is a constant and matches. The page table's length is a capacity
  (`PagedShape.table_capacity`): entries past `indptr[B]` are never read.
- **Scalar parameters.** `rotary_mode`, `rope_scale`, `rope_theta` and `sm_scale` are kernel
  arguments taken from the host call; a flat launch list has no host values to pass, so they are
  specialized to constants. `rotary_mode` is 0: tvmpipe's decode step applies rotary itself before
  the attention (compiler/decoders.py), and K is stored in the pages already rotated, so the kernel
  must not rotate again. With it 0 the kernel no longer reads `k_rope_pos_offset` and
  `q_rope_position`; the launch does not pass them (the host code read by launches.py says which
  function arguments each kernel takes).
- **Schedules.** The decode kernel comes scheduled (thread bindings, `tirx.is_scheduled`); the
  append is a plain loop nest and gets dlight's `gpu.Fallback`, as TVM's own test does.

`lse` (an output of the decode kernel, [B, H_qo] float32) is in log2 units (the kernel works with
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
APPEND = "paged_append"


@dataclass(frozen=True)
class PagedShape:
    """The static sizes one decode step's paged kernels are built for.

    `rows` is the step's rows (batch x slots), `tokens` the new tokens a step writes (rows x chunk),
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
        if self.dtype not in ("float16", "float32"):
            raise CompileError(f"paged KV pages of {self.dtype}: only float16 and float32 are built")
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

    One parameter at a time, in order, so that a shape derived from an earlier one's variable
    (`(B + 1,)`) is a constant by the time it is bound. Each given shape is checked against the
    parameter's own (after the earlier bindings) by specialize itself."""
    from tvm import tirx

    scalars = dict(scalars or {})
    names = [p.name for p in func.params]
    buffers = iter(shapes)
    for name in names:
        param = next(p for p in func.params if p.name == name)
        shape = getattr(param, "shape", None)
        if shape is not None and len(shape):
            _, dims, dtype = next(buffers)
            if len(dims) != len(shape):
                raise CompileError(f"internal: {name} has {len(shape)} dimensions, given {dims}")
            static = [d if isinstance(d, tirx.IntImm) and int(d) == n else tirx.IntImm(str(d.ty), n)
                      for d, n in zip(shape, dims)]
            if str(param.dtype) != dtype:
                raise CompileError(f"internal: {name} is {param.dtype}, given {dtype}")
            func = func.specialize({param: tirx.decl_buffer(static, dtype, name)})
        else:
            if name not in scalars:
                raise CompileError(f"internal: no value for scalar parameter {name}")
            value = scalars.pop(name)
            dt = str(param.ty.dtype) if hasattr(param.ty, "dtype") else str(param.dtype)
            const = tirx.FloatImm(dt, float(value)) if "float" in dt else tirx.IntImm(dt, int(value))
            func = func.specialize({param: const})
    if scalars:
        raise CompileError(f"internal: {sorted(scalars)} are not parameters of {func}")
    return func


def decode_scalars(shape: PagedShape) -> dict[str, float | int]:
    """The decode kernel's scalar parameters: no rotary inside the kernel (the step applies it)."""
    return {"rotary_mode": 0, "rope_scale": 1.0, "rope_theta": 10000.0, "sm_scale": shape.sm_scale}


def decode_func(shape: PagedShape, target: Any) -> Any:
    """`batch_decode_paged_kv` for `target` (scheduled by its generator), static."""
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

    f = _attention_decode(shape.num_kv_heads, shape.num_qo_heads, shape.head_dim, shape.dtype, False, {}, target,
                          shape.page_size)
    return specialize_static(f, shape.decode_args(), decode_scalars(shape))


def decode_func_cpu(shape: PagedShape) -> Any:
    """The llvm variant (`_attention_decode_cpu`), static the same way: what the tests run here."""
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu

    f = _attention_decode_cpu(shape.num_kv_heads, shape.num_qo_heads, shape.head_dim, shape.dtype, False, {},
                              shape.page_size)
    return specialize_static(f, shape.decode_args(), decode_scalars(shape))


def append_func(shape: PagedShape) -> Any:
    """`tir_kv_cache_transpose_append`, static and unscheduled (it runs as is on llvm)."""
    from tvm.relax.frontend.nn.llm._page_kernels import _kv_cache_transpose_append

    f = _kv_cache_transpose_append(shape.num_kv_heads, shape.head_dim, shape.dtype, shape.page_size)
    return specialize_static(f, shape.append_args())


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
    """Specialize, schedule (append: dlight gpu.Fallback) and lower both kernels for CUDA `arch`."""
    import tvm
    import tvm.s_tir.dlight as dl

    from tvmpipe.compiler import launches

    launches.check_arch(arch)
    target = launches.cuda_target(arch)
    with target:
        append = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(tvm.IRModule({APPEND: append_func(shape)}))[APPEND]
    funcs = {DECODE: decode_func(shape, target), APPEND: append}
    lowered = {name: launches.lower_function(name, f, target) for name, f in funcs.items()}
    device = {sym: f for low in lowered.values() for sym, f in low.device_funcs.items()}
    return PagedKernels(shape=shape, functions={n: low.kernels for n, low in lowered.items()},
                        args={DECODE: shape.decode_args(), APPEND: shape.append_args()},
                        cuda_source=launches.cuda_source(device, target))
