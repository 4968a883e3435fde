"""compiler/pagedkv.py and executor/paged_attention.py (issue 53): TVM's paged-KV kernels agree with
the NumPy oracle, the oracle is ordinary attention, and the CUDA kernels build as flat launch lists.

TVM's llvm variants of the kernels (`_attention_decode_cpu`, the append as is), made static the same
way as the CUDA ones, run here on random pools: rows of different lengths (one empty, as a batch's
idle row is; one ending on a page boundary; the others with partly filled last pages), pages taken
from a shuffled pool, grouped-query 4:1 and 1:1, float32 and float16. The pool starts as random
garbage, so a kernel reading a slot past a row's length, or a page that is not the row's, shows.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from tvmpipe.executor import paged_attention as pa

TOL = {"float32": 1e-5, "float16": 1e-3}
LENGTHS = [0, 1, 16, 21, 37, 48]  # tokens held by each row


def random_table(rng: np.random.Generator, lengths: list[int], page_size: int, num_pages: int, capacity: int):
    """A CSR page table over a shuffled pool: each row's pages are distinct and in no order."""
    counts = [-(-n // page_size) for n in lengths]
    pool = rng.permutation(num_pages)[:sum(counts)]
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    values = np.full(capacity, -7, np.int32)  # entries past indptr[B] are never read
    values[:sum(counts)] = pool
    last = np.array([(n - 1) % page_size + 1 if n else 0 for n in lengths], np.int32)
    return indptr, values, last


def shape_for(hkv: int, hq: int, dtype: str, tokens: int = 8):
    from tvmpipe.compiler.pagedkv import PagedShape

    return PagedShape(num_kv_heads=hkv, num_qo_heads=hq, head_dim=32, dtype=dtype, page_size=16,
                      rows=len(LENGTHS), num_pages=20, table_capacity=24, tokens=tokens)


# ---- the oracle against plain attention (no TVM) ---------------------------------------------------


def torch_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False) -> np.ndarray:
    """q [n, Hq, D], the last n of L tokens, over k/v [L, Hkv, D] with torch's
    scaled_dot_product_attention, KV heads repeated; causal: query j sees the first L - n + j + 1."""
    import torch

    group = q.shape[1] // k.shape[1]
    n, length = q.shape[0], k.shape[0]
    qt = torch.from_numpy(q.astype(np.float32)).transpose(0, 1)  # [Hq, n, D]
    kt = torch.from_numpy(k.astype(np.float32)).transpose(0, 1).repeat_interleave(group, 0)  # [Hq, L, D]
    vt = torch.from_numpy(v.astype(np.float32)).transpose(0, 1).repeat_interleave(group, 0)
    mask = torch.ones(n, length, dtype=torch.bool)
    if causal:
        mask = torch.arange(length)[None, :] < (length - n + torch.arange(n) + 1)[:, None]
    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(0, 1).numpy()


@pytest.mark.parametrize("hkv, hq", [(2, 8), (4, 4)])
def test_the_oracle_is_ordinary_attention_over_each_rows_tokens_in_order(hkv, hq):
    pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    d, page_size, num_pages = 32, 16, 20
    indptr, values, last = random_table(rng, LENGTHS, page_size, num_pages, 24)
    pages = rng.standard_normal((num_pages, 2, hkv, page_size, d)).astype(np.float32)
    tokens_k = [rng.standard_normal((n, hkv, d)).astype(np.float32) for n in LENGTHS]
    tokens_v = [rng.standard_normal((n, hkv, d)).astype(np.float32) for n in LENGTHS]
    for b, n in enumerate(LENGTHS):  # write each row's tokens through its page table, in two steps
        for lo, hi in ((0, n // 2), (n // 2, n)):
            pa.append(pages, tokens_k[b][lo:hi], tokens_v[b][lo:hi],
                      pa.position_map(indptr, values, page_size, b, lo, hi - lo))
    q = rng.standard_normal((len(LENGTHS), hq, d)).astype(np.float32)
    out, lse = pa.decode(q, pages, indptr, values, last)
    for b, n in enumerate(LENGTHS):
        k, v = pa.gather_kv(pages, pa.row_pages(indptr, values, b), n)
        np.testing.assert_array_equal(k, tokens_k[b])  # the append put every token where the table says
        np.testing.assert_array_equal(v, tokens_v[b])
        if n == 0:
            assert not out[b].any() and (lse[b] == pa.EMPTY_LSE).all()
            continue
        np.testing.assert_allclose(out[b], torch_attention(q[b][None], tokens_k[b], tokens_v[b])[0], rtol=1e-5, atol=1e-5)
        s = np.einsum("hd,lhd->hl", q[b], np.repeat(tokens_k[b], hq // hkv, axis=1)) / np.sqrt(d)
        np.testing.assert_allclose(lse[b], np.log2(np.exp(s).sum(axis=1)), rtol=1e-5)

    # a chunk: each row's last min(length, 3) tokens as queries, causal among themselves
    counts = [min(n, 3) for n in LENGTHS]
    q_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    qc = rng.standard_normal((int(q_indptr[-1]) + 2, hq, d)).astype(np.float32)  # 2 spare slots
    outc, _ = pa.prefill(qc, q_indptr, pages, indptr, values, last)
    assert not outc[q_indptr[-1]:].any()
    for b, n in enumerate(LENGTHS):
        lo, hi = q_indptr[b], q_indptr[b + 1]
        if hi > lo:
            np.testing.assert_allclose(outc[lo:hi], torch_attention(qc[lo:hi], tokens_k[b], tokens_v[b], causal=True),
                                       rtol=1e-5, atol=1e-5)
    # the chunk's last query sees the whole row: what a decode of that query gives
    lastq = np.stack([qc[q_indptr[b + 1] - 1] if counts[b] else np.zeros((hq, d), np.float32) for b in range(len(LENGTHS))])
    np.testing.assert_allclose(pa.decode(lastq, pages, indptr, values, last)[0][[b for b, c in enumerate(counts) if c]],
                               outc[q_indptr[1:][np.array(counts) > 0] - 1], rtol=1e-6, atol=1e-6)


def test_the_oracle_refuses_contradictory_tables():
    pages = np.zeros((4, 2, 1, 16, 8), np.float32)
    with pytest.raises(pa.PageTableError, match="twice"):
        pa.append(pages, np.ones((2, 1, 8), np.float32), np.ones((2, 1, 8), np.float32), np.array([3, 3], np.int32))
    with pytest.raises(pa.PageTableError, match="outside the pool"):
        pa.gather_kv(pages, np.array([4]), 1)
    with pytest.raises(pa.PageTableError, match="last page"):
        pa.decode(np.zeros((1, 1, 8), np.float32), pages, np.array([0, 1]), np.array([0]), np.array([17]))


# ---- TVM's kernels (llvm variants) against the oracle ----------------------------------------------


def build_cpu(shape):
    import tvm

    from tvmpipe.compiler.pagedkv import append_func, decode_func_cpu, prefill_func_cpu

    return [tvm.compile(tvm.IRModule({"main": f}), target="llvm")["main"]
            for f in (decode_func_cpu(shape), append_func(shape), prefill_func_cpu(shape))]


@pytest.mark.tvm
@pytest.mark.parametrize("hkv, hq, dtype", [(2, 8, "float32"), (4, 4, "float32"), (2, 8, "float16"),
                                            (4, 4, "float16")])
def test_tvm_paged_kernels_agree_with_the_oracle(hkv, hq, dtype):
    tvm = pytest.importorskip("tvm")
    shape = shape_for(hkv, hq, dtype)
    decode, append, prefill = build_cpu(shape)
    rng = np.random.default_rng(11)
    indptr, values, last = random_table(rng, LENGTHS, shape.page_size, shape.num_pages, shape.table_capacity)
    garbage = rng.standard_normal(shape.pool_shape).astype(dtype)
    ref_pages, tvm_pages = garbage.copy(), tvm.runtime.tensor(garbage.copy())

    # every row's tokens, appended `shape.tokens` at a time; the last call's spare slots are -1
    kv = [(rng.standard_normal((n, hkv, 32)).astype(dtype), rng.standard_normal((n, hkv, 32)).astype(dtype))
          for n in LENGTHS]
    allk = np.concatenate([k for k, _ in kv])
    allv = np.concatenate([v for _, v in kv])
    allpos = np.concatenate([pa.position_map(indptr, values, shape.page_size, b, 0, n) for b, n in enumerate(LENGTHS)])
    for lo in range(0, len(allpos), shape.tokens):
        k = np.zeros((shape.tokens, hkv, 32), dtype)
        v = np.zeros_like(k)
        pos = np.full(shape.tokens, -1, np.int32)
        n = min(shape.tokens, len(allpos) - lo)
        k[:n], v[:n], pos[:n] = allk[lo:lo + n], allv[lo:lo + n], allpos[lo:lo + n]
        pa.append(ref_pages, k, v, pos)
        append(tvm_pages, tvm.runtime.tensor(k), tvm.runtime.tensor(v), tvm.runtime.tensor(pos))
    np.testing.assert_array_equal(tvm_pages.numpy(), ref_pages)  # a copy: exact, garbage untouched

    q = rng.standard_normal((shape.rows, hq, 32)).astype(dtype)
    out = tvm.runtime.tensor(np.full((shape.rows, hq, 32), 99, dtype))
    lse = tvm.runtime.tensor(np.zeros((shape.rows, hq), np.float32))
    unused = tvm.runtime.tensor(np.zeros(shape.rows, np.int32))  # the rope offsets: read only with rotary
    decode(tvm.runtime.tensor(q), tvm_pages, tvm.runtime.tensor(indptr), tvm.runtime.tensor(values),
           tvm.runtime.tensor(last), unused, unused, out, lse)
    want_out, want_lse = pa.decode(q, ref_pages, indptr, values, last)
    tol = TOL[dtype]
    np.testing.assert_allclose(out.numpy().astype(np.float32), want_out.astype(np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=tol, atol=tol)

    # a chunked step: each row's last 0-2 tokens as queries (8 slots, the spare ones past q_indptr[B])
    counts = [0, 1, 2, 1, 2, 2]
    q_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    qc = rng.standard_normal((shape.tokens, hq, 32)).astype(dtype)
    outc = tvm.runtime.tensor(np.zeros((shape.tokens, hq, 32), dtype))
    lsec = tvm.runtime.tensor(np.zeros((shape.tokens, hq), np.float32))
    prefill(tvm.runtime.tensor(qc), tvm.runtime.tensor(q_indptr), tvm_pages, tvm.runtime.tensor(indptr),
            tvm.runtime.tensor(values), tvm.runtime.tensor(last), unused, tvm.runtime.tensor(np.zeros(shape.tokens, np.int32)),
            outc, lsec)
    want_out, want_lse = pa.prefill(qc, q_indptr, ref_pages, indptr, values, last)
    n = q_indptr[-1]
    np.testing.assert_allclose(outc.numpy()[:n].astype(np.float32), want_out[:n].astype(np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(lsec.numpy()[:n], want_lse[:n], rtol=tol, atol=tol)


# ---- the CUDA kernels as launch lists ---------------------------------------------------------------

# the CUDA kernels' parameter names (TVM's buffer names + "_ptr") for tvmpipe's argument names
TVM_NAMES = {"paged_decode": {"q": "Q", "last_page_len": "length_info"},
             "paged_prefill": {"last_page_len": "length_info", "page_table_indptr": "page_indptr",
                               "page_table_values": "page_values"},
             "paged_append": {"k": "k_data", "v": "v_data"}}


@pytest.fixture(scope="module")
def cuda_kernels():
    pytest.importorskip("tvm")
    from tvmpipe.compiler.pagedkv import build_paged_kernels

    return {dtype: build_paged_kernels(shape_for(hkv, hq, dtype)) for hkv, hq, dtype in
            [(2, 8, "float16"), (4, 4, "float32")]}


@pytest.mark.tvm
def test_cuda_kernels_are_one_static_launch_each(cuda_kernels):
    for kernels in cuda_kernels.values():
        s = kernels.shape
        assert kernels.launch_count() == {"paged_decode": 1, "paged_prefill": 1, "paged_append": 1}
        (dec,), (app,) = kernels.functions["paged_decode"].launches, kernels.functions["paged_append"].launches
        assert dec.grid[0] == s.rows and dec.grid[1] % s.num_kv_heads == 0  # a block per row and KV head (group)
        assert not any(f.workspaces for f in kernels.functions.values())
        assert app.grid[0] * app.block[0] >= s.tokens * s.num_kv_heads * s.head_dim
        (pre,) = kernels.functions["paged_prefill"].launches
        for fn, launch in (("paged_decode", dec), ("paged_prefill", pre), ("paged_append", app)):
            args = kernels.args[fn]
            assert all(a.kind == "arg" and 0 <= a.index < len(args) for a in launch.args)
            # in the kernel's own parameter order, each operand is the buffer of that name
            m = re.search(rf"void __launch_bounds__\(\d+\) {launch.kernel}\(([^)]*)\)", kernels.cuda_source)
            params = [p.split()[-1].removesuffix("_ptr") for p in m.group(1).split(",")]
            named = [TVM_NAMES[fn].get(args[a.index][0], args[a.index][0]) for a in launch.args]
            assert params == named, (fn, params, named)
        # no rotary in the kernel: its rope offsets are not passed
        assert {kernels.args["paged_decode"][a.index][0] for a in dec.args} == {
            "q", "pages", "page_table_indptr", "page_table_values", "last_page_len", "output", "lse"}
        assert {kernels.args["paged_prefill"][a.index][0] for a in pre.args} == {
            "q", "q_indptr", "pages", "page_table_indptr", "page_table_values", "last_page_len", "output", "lse"}


@pytest.mark.tvm
def test_cuda_kernels_build_for_sm90_and_take_their_launches_arguments(cuda_kernels, tmp_path):
    from tests.support.cubin_elf import compile_and_read

    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc not installed")
    for dtype, kernels in cuda_kernels.items():
        compiled = compile_and_read(nvcc, kernels.cuda_source, "sm_90", tmp_path)
        for fn, kf in kernels.functions.items():
            for launch in kf.launches:
                k = compiled[launch.kernel]
                assert len(k.params) == len(launch.args), (dtype, fn)
                assert k.max_threads is None or launch.threads <= k.max_threads
                assert (k.static_smem or 0) + launch.shared_mem <= 49152


@pytest.mark.tvm
def test_the_kernels_do_not_depend_on_the_pools_page_count(cuda_kernels):
    """The pool's page count is the outermost axis of every pool index (a page's stride does not
    depend on it): the kernels built for a pool of 20 pages and of 4096 are the same CUDA source and
    the same launches, so a pool sized at run time (bundle/pool.py, `--kv-tokens`) runs the
    compiled kernels."""
    import dataclasses

    from tvmpipe.compiler.pagedkv import build_paged_kernels

    small = cuda_kernels["float16"]
    big = build_paged_kernels(dataclasses.replace(small.shape, num_pages=4096))
    assert big.cuda_source == small.cuda_source
    assert big.functions == small.functions
    assert big.args["paged_decode"][1][1][0] == 4096 and small.args["paged_decode"][1][1][0] == 20
