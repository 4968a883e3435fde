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
"""

from __future__ import annotations

from typing import Any, Callable

NAMESPACE = "tvmpipe"
_REGISTERED: list[bool] = []


def register_torch_ops() -> None:
    """Define the two ops in torch (once a process)."""
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


def converters(target: Any | None) -> dict[str, Callable[[Any, Any], Any]]:
    """`custom_convert_map` entries for the two ops, building the kernels for `target` (a CUDA
    target: the scheduled kernels; None: the llvm variants)."""
    from tvmpipe.compiler import pagedkv

    def shape_of(q_or_k: Any, pages: Any, values: Any | None, rows: int, tokens: int) -> pagedkv.PagedShape:
        n, _, hkv, page_size, d = _dims(pages)
        return pagedkv.PagedShape(num_kv_heads=hkv, num_qo_heads=_dims(q_or_k)[1], head_dim=d,
                                  dtype=str(pages.ty.dtype), page_size=page_size, rows=rows, num_pages=n,
                                  table_capacity=_dims(values)[0] if values is not None else 1, tokens=tokens)

    def append(node: Any, importer: Any) -> Any:
        import tvm.s_tir.dlight as dl
        from tvm import IRModule, relax

        pages, k, v, pos = _args(node, importer)
        shape = shape_of(k, pages, None, rows=1, tokens=_dims(k)[0])
        func = pagedkv.append_func(shape)
        if target is not None:
            with target:
                func = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(IRModule({"f": func}))["f"]
        gv = importer.block_builder.add_func(func, pagedkv.APPEND)
        return importer.block_builder.emit(relax.call_tir_inplace(gv, [pages, k, v, pos], [0], pages.ty))

    def decode(node: Any, importer: Any) -> Any:
        import numpy as np
        from tvm import relax

        q, pages, indptr, values, last = _args(node, importer)
        rows = _dims(q)[0]
        shape = shape_of(q, pages, values, rows=rows, tokens=rows)
        func = pagedkv.decode_func(shape, target) if target is not None else pagedkv.decode_func_cpu(shape)
        gv = importer.block_builder.add_func(func, pagedkv.DECODE)
        zeros = relax.const(np.zeros(rows, np.int32))
        out = importer.block_builder.emit(relax.call_tir(
            gv, [q, pages, indptr, values, last, zeros, zeros],
            [relax.TensorType(_dims(q), shape.dtype), relax.TensorType([rows, shape.num_qo_heads], "float32")]))
        return importer.block_builder.emit(relax.TupleGetItem(out, 0))

    def prefill(node: Any, importer: Any) -> Any:
        import numpy as np
        from tvm import relax

        q, q_indptr, pages, indptr, values, last = _args(node, importer)
        rows, tokens = _dims(q_indptr)[0] - 1, _dims(q)[0]
        shape = shape_of(q, pages, values, rows=rows, tokens=tokens)
        func = pagedkv.prefill_func(shape, target) if target is not None else pagedkv.prefill_func_cpu(shape)
        gv = importer.block_builder.add_func(func, pagedkv.PREFILL)
        out = importer.block_builder.emit(relax.call_tir(
            gv, [q, q_indptr, pages, indptr, values, last, relax.const(np.zeros(rows, np.int32)),
                 relax.const(np.zeros(tokens, np.int32))],
            [relax.TensorType(_dims(q), shape.dtype), relax.TensorType([tokens, shape.num_qo_heads], "float32")]))
        return importer.block_builder.emit(relax.TupleGetItem(out, 0))

    return {"paged_append.default": append, "paged_decode.default": decode, "paged_prefill.default": prefill}
