"""The paged kernels as torch ops that torch.export traces and TVM's importer turns into calls of
compiler/pagedkv.py's PrimFuncs: the way a decode step's graph will reach them (docs/paged-kv.md).

- `tvmpipe::paged_append(pages, k, v, position_map) -> pages`: functional in torch (a new pool
  with the step's K/V written at the positions; -1 skips), so torch.export needs no mutation
  handling. The importer emits `R.call_tir_inplace(tir_kv_cache_transpose_append, ..., [0])`:
  the pool is written in place, which is sound because the step's pool input is read by nothing
  else (the state pair's input; its output is the append's result).
- `tvmpipe::paged_decode(q, pages, page_table_indptr, page_table_values, last_page_len) -> out`:
  one query a row over its pages; the importer emits `R.call_tir(batch_decode_paged_kv, ...)`
  with zero rope offsets (the kernel reads them only with rotary on, and rotary is off) and keeps
  the attention output, dropping `lse`.
- `tvmpipe::paged_prefill(q, q_indptr, pages, page_table_indptr, page_table_values, last_page_len)
  -> out`: a chunked step's queries (packed by `q_indptr`: row b's are its last tokens, already
  appended), causal; `R.call_tir(batch_prefill_paged_kv, ...)` likewise.

The torch implementations are plain gathers and softmax attention (the compiler layer does not
import the executor's NumPy oracle; the tests compare the two). `converters(target)` gives the
importer's `custom_convert_map` entries; `target` None builds the llvm variants, which run here.
They join the other converters a step's import takes (compiler/importops.py: a checkpoint's or a
GGUF file's half-precision matmuls, the packed weights' shifts): their op names do not meet.
A step converted after import (`--dtype float16` on a float32 built-in: compiler/precision.py)
has its paged calls rebuilt for float16 pages by `in_dtype`.
"""

from __future__ import annotations

from typing import Any, Callable

from tvmpipe.compiler import pagedkv
from tvmpipe.compiler.pagedkv import APPEND, DECODE, PREFILL

NAMESPACE = "tvmpipe"
_REGISTERED: list[bool] = []


def register_torch_ops() -> None:
    """Define the three ops in torch (once a process)."""
    if _REGISTERED:
        return
    import torch

    # schemas given: this module's annotations are strings (`from __future__ import annotations`)
    @torch.library.custom_op(f"{NAMESPACE}::paged_append", mutates_args=(),
                             schema="(Tensor pages, Tensor k, Tensor v, Tensor position_map) -> Tensor")
    def paged_append(pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_map: torch.Tensor) -> torch.Tensor:
        out = pages.clone()
        page_size = pages.shape[3]
        live = position_map >= 0
        pos = position_map[live].long()
        out[pos // page_size, 0, :, pos % page_size, :] = k[live]
        out[pos // page_size, 1, :, pos % page_size, :] = v[live]
        return out

    @paged_append.register_fake
    def _(pages, k, v, position_map):  # noqa: ANN001, ANN202 - torch's fake-kernel signature
        return torch.empty_like(pages)

    @torch.library.custom_op(f"{NAMESPACE}::paged_decode", mutates_args=(),
                             schema="(Tensor q, Tensor pages, Tensor page_table_indptr, Tensor page_table_values, "
                                    "Tensor last_page_len) -> Tensor")
    def paged_decode(q: torch.Tensor, pages: torch.Tensor, page_table_indptr: torch.Tensor,
                     page_table_values: torch.Tensor, last_page_len: torch.Tensor) -> torch.Tensor:
        rows, hq, d = q.shape
        hkv, page_size = pages.shape[2], pages.shape[3]
        out = torch.zeros(rows, hq, d, dtype=torch.float32)
        for b in range(rows):
            ids = page_table_values[int(page_table_indptr[b]):int(page_table_indptr[b + 1])].long()
            if ids.numel() == 0:
                continue
            length = (ids.numel() - 1) * page_size + int(last_page_len[b])
            kv = pages[ids].permute(1, 2, 0, 3, 4).reshape(2, hkv, -1, d)[:, :, :length].float()  # [2, Hkv, L, D]
            k, v = kv[0].repeat_interleave(hq // hkv, 0), kv[1].repeat_interleave(hq // hkv, 0)
            out[b] = torch.nn.functional.scaled_dot_product_attention(q[b].float()[:, None, :], k, v)[:, 0, :]
        return out.to(q.dtype)

    @paged_decode.register_fake
    def _(q, pages, page_table_indptr, page_table_values, last_page_len):  # noqa: ANN001, ANN202
        return torch.empty_like(q)

    @torch.library.custom_op(f"{NAMESPACE}::paged_prefill", mutates_args=(),
                             schema="(Tensor q, Tensor q_indptr, Tensor pages, Tensor page_table_indptr, "
                                    "Tensor page_table_values, Tensor last_page_len) -> Tensor")
    def paged_prefill(q: torch.Tensor, q_indptr: torch.Tensor, pages: torch.Tensor, page_table_indptr: torch.Tensor,
                      page_table_values: torch.Tensor, last_page_len: torch.Tensor) -> torch.Tensor:
        total, hq, d = q.shape
        hkv, page_size = pages.shape[2], pages.shape[3]
        out = torch.zeros(total, hq, d, dtype=torch.float32)
        for b in range(len(q_indptr) - 1):
            lo, hi = int(q_indptr[b]), int(q_indptr[b + 1])
            ids = page_table_values[int(page_table_indptr[b]):int(page_table_indptr[b + 1])].long()
            if hi == lo or ids.numel() == 0:
                continue
            length = (ids.numel() - 1) * page_size + int(last_page_len[b])
            kv = pages[ids].permute(1, 2, 0, 3, 4).reshape(2, hkv, -1, d)[:, :, :length].float()
            k, v = kv[0].repeat_interleave(hq // hkv, 0), kv[1].repeat_interleave(hq // hkv, 0)
            n = hi - lo  # query j sees the first length - n + j + 1 tokens
            mask = torch.arange(length)[None, :] < (length - n + torch.arange(n) + 1)[:, None]
            out[lo:hi] = torch.nn.functional.scaled_dot_product_attention(
                q[lo:hi].float().transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)
        return out.to(q.dtype)

    @paged_prefill.register_fake
    def _(q, q_indptr, pages, page_table_indptr, page_table_values, last_page_len):  # noqa: ANN001, ANN202
        return torch.empty_like(q)

    _REGISTERED.append(True)


def _args(node: Any, importer: Any) -> list[Any]:
    return [importer.env[a] for a in node.args]


def _dims(value: Any) -> list[int]:
    return [int(d) for d in value.ty.shape.values]


def _rope_zeros(op: str, shape: Any) -> list[Any]:
    """The kernels' rope-offset arguments (`k_rope_pos_offset` [rows], `q_rope_position` [rows or
    tokens]): zeros, which the kernels never read with rotary off (one constant where both are
    [rows])."""
    import numpy as np
    from tvm import relax

    rows = relax.const(np.zeros(shape.rows, np.int32))
    return [rows, rows if op == DECODE else relax.const(np.zeros(shape.tokens, np.int32))]


def _call(op: str, gv: Any, args: list[Any], shape: Any) -> Any:
    """The Relax call of paged PrimFunc `gv` on `args` (its tensor arguments, the rope zeros
    included): the append in place over the pool (argument 0), the attention's (output, lse)."""
    from tvm import relax

    if op == APPEND:
        return relax.call_tir_inplace(gv, args, [0], relax.TensorType(list(shape.pool_shape), shape.dtype))
    queries = shape.rows if op == DECODE else shape.tokens
    return relax.call_tir(gv, args, [relax.TensorType([queries, shape.num_qo_heads, shape.head_dim], shape.dtype),
                                     relax.TensorType([queries, shape.num_qo_heads], "float32")])


def converters(target: Any | None) -> dict[str, Callable[[Any, Any], Any]]:
    """`custom_convert_map` entries for the three ops, building the kernels for `target` (a CUDA
    target: the scheduled kernels; None: the llvm variants), in the dtype of the step's pools."""
    from tvm import relax

    def convert(op: str, pool_arg: int) -> Callable[[Any, Any], Any]:
        def emit(node: Any, importer: Any) -> Any:
            args = _args(node, importer)
            shape = pagedkv.shape_of_call(op, [_dims(a) for a in args], str(args[pool_arg].ty.dtype))
            gv = importer.block_builder.add_func(pagedkv.step_func(op, shape, target), op)
            out = importer.block_builder.emit(_call(op, gv, args if op == APPEND else args + _rope_zeros(op, shape),
                                                    shape))
            return out if op == APPEND else importer.block_builder.emit(relax.TupleGetItem(out, 0))

        return emit

    return {"paged_append.default": convert(APPEND, 0), "paged_decode.default": convert(DECODE, 1),
            "paged_prefill.default": convert(PREFILL, 2)}


def in_dtype(value: Any, args: list[Any], dtype: str, target: Any | None, funcs: dict[Any, Any]) -> Any:
    """A step's paged call `value` (a `call_tir` / `call_tir_inplace` of a paged PrimFunc,
    compiler/opmap.py `paged_op`) once the step is converted to `dtype` (compiler/precision.py:
    `args`, the call's arguments re-emitted, now hold pools and q/k/v of `dtype`): the same call
    with outputs of `dtype` (lse stays float32), and its PrimFunc rebuilt for pages of `dtype`
    for `target` as the converters build it, into `funcs` (PrimFunc GlobalVar -> new function,
    once a function: the layers of one shape share it), which the caller puts in the module.
    The kernels are generated per dtype, so converting their bodies would not do."""
    from tvmpipe.compiler.opmap import paged_op

    op = paged_op(value)
    gv, tensors = args[0], list(args[1].fields)
    shape = pagedkv.shape_of_call(op, [_dims(t) for t in tensors], dtype)
    if gv not in funcs:
        funcs[gv] = pagedkv.step_func(op, shape, target)
    return _call(op, gv, tensors, shape)
