"""compiler/pagedops.py: the paged kernels as torch ops, traced by torch.export and imported by TVM's
importer as calls of compiler/pagedkv.py's PrimFuncs (the pool appended in place, then attended by
one query a row and by a causal chunk);
the torch ops equal the NumPy oracle, and the imported program, built for llvm, equals torch."""

from __future__ import annotations

import numpy as np
import pytest

from tvmpipe.executor import paged_attention as pa

torch = pytest.importorskip("torch")
B, HQ, HKV, D, P, N = 3, 8, 2, 32, 16, 6


Q_INDPTR = [0, 2, 4, 5]  # the chunk: rows' last 2, 2 and 1 tokens (row 1's 2 cross a page boundary)


def step_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, D, generator=g) for h in (HQ, HKV, HKV))
    pages = torch.randn(N, 2, HKV, P, D, generator=g)  # garbage where no token is
    indptr = torch.tensor([0, 1, 3, 4], dtype=torch.int32)  # rows of 1, 2 and 1 pages, out of order
    values = torch.tensor([4, 0, 2, 5, 1, 3], dtype=torch.int32)  # the last two: past indptr[B], unread
    last = torch.tensor([5, 1, 16], dtype=torch.int32)  # lengths 5, 17, 16
    # each row's new token is its last: row 0 at 4 of page 4, row 1 at 0 of page 2, row 2 at 15 of page 5
    pos = torch.tensor([4 * P + 4, 2 * P + 0, 5 * P + 15], dtype=torch.int32)
    qc = torch.randn(Q_INDPTR[-1] + 1, HQ, D, generator=g)  # one spare query slot
    return q, k, v, pages, indptr, values, last, pos, qc


def module():
    from tvmpipe.compiler.pagedops import register_torch_ops

    register_torch_ops()

    class Step(torch.nn.Module):
        def forward(self, q, k, v, pages, indptr, values, last, pos, qc):
            new = torch.ops.tvmpipe.paged_append(pages, k, v, pos)
            chunk = torch.ops.tvmpipe.paged_prefill(qc, torch.tensor(Q_INDPTR, dtype=torch.int32), new, indptr,
                                                     values, last)
            return torch.ops.tvmpipe.paged_decode(q, new, indptr, values, last), new, chunk

    return Step()


def test_the_torch_ops_equal_the_oracle():
    args = step_inputs()
    out, new, chunk = module()(*args)
    q, k, v, pages, indptr, values, last, pos, qc = (a.numpy() for a in args)
    ref = pages.copy()
    pa.append(ref, k, v, pos)
    np.testing.assert_array_equal(new.numpy(), ref)
    assert not np.array_equal(ref, pages)
    np.testing.assert_allclose(out.numpy(), pa.decode(q, ref, indptr, values, last)[0], rtol=1e-5, atol=1e-5)
    want = pa.prefill(qc, np.array(Q_INDPTR), ref, indptr, values, last)[0]
    np.testing.assert_allclose(chunk.numpy()[:Q_INDPTR[-1]], want[:Q_INDPTR[-1]], rtol=1e-5, atol=1e-5)


@pytest.mark.tvm
def test_imported_step_appends_in_place_then_attends_and_equals_torch():
    tvm = pytest.importorskip("tvm")
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    from tvmpipe.compiler.pagedops import converters

    args = step_inputs(1)
    step = module()
    want_out, want_pages, want_chunk = step(*args)
    ep = torch.export.export(step, args)
    mod = from_exported_program(ep, keep_params_as_input=True, custom_convert_map=converters(None))
    calls = [b.value for blk in mod["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]
    tir = [(c.op.name, c.args[0].name_hint) for c in calls if c.op.name.startswith("relax.call_tir")]
    assert tir == [("relax.call_tir_inplace", "paged_append"), ("relax.call_tir", "paged_prefill"),
                   ("relax.call_tir", "paged_decode")]
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    out, pages, chunk = vm["main"](*[tvm.runtime.tensor(a.numpy().copy()) for a in args])
    np.testing.assert_array_equal(pages.numpy(), want_pages.numpy())
    np.testing.assert_allclose(out.numpy(), want_out.numpy(), rtol=1e-5, atol=1e-5)
    n = Q_INDPTR[-1]  # the spare slot is not computed by the kernel
    np.testing.assert_allclose(chunk.numpy()[:n], want_chunk.numpy()[:n], rtol=1e-5, atol=1e-5)


@pytest.mark.tvm
def test_imported_for_cuda_each_op_is_one_launch():
    pytest.importorskip("tvm")
    from tvm.relax.frontend.torch import from_exported_program

    from tvmpipe.compiler.launches import cuda_target, lower_function
    from tvmpipe.compiler.pagedops import converters

    target = cuda_target("sm_90")
    mod = from_exported_program(torch.export.export(module(), step_inputs()), keep_params_as_input=True,
                                custom_convert_map=converters(target))
    for name in ("paged_append", "paged_decode", "paged_prefill"):
        lowered = lower_function(name, mod[name], target)
        assert len(lowered.kernels.launches) == 1 and not lowered.kernels.workspaces


@pytest.mark.tvm
def test_fusion_leaves_each_paged_kernel_its_own_function():
    """Legalize + AnnotateTIROpPattern find the paged PrimFuncs opaque, so FuseOps/FuseTIR fuse the
    elementwise ops around them but never into them: one call (one launch) each in the step."""
    tvm = pytest.importorskip("tvm")
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    from tvmpipe.compiler.launches import cuda_target
    from tvmpipe.compiler.pagedops import converters

    inner = module()

    class Around(torch.nn.Module):  # elementwise producers and consumers FuseOps would like to fuse
        def forward(self, q, k, v, pages, indptr, values, last, pos, qc):
            out, new, chunk = inner(q * 2, k + 1, v, pages, indptr, values, last, pos, qc)
            return out * 3, new, chunk + 1

    mod = from_exported_program(torch.export.export(Around(), step_inputs()), keep_params_as_input=True,
                                custom_convert_map=converters(cuda_target("sm_90")))
    mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                    relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
    called = [b.value.args[0].name_hint for blk in mod["main"].body.blocks for b in blk.bindings
              if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)
              and b.value.op.name.startswith("relax.call_tir")]
    assert sorted(n for n in called if n.startswith("paged_")) == ["paged_append", "paged_decode", "paged_prefill"]
    assert all(int(mod[n].attrs["op_pattern"]) == 8 for n in ("paged_append", "paged_decode", "paged_prefill"))
    assert len(called) == 7  # q * 2, k + 1, the three paged calls, out * 3, chunk + 1: nothing fused into them
