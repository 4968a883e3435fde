"""Half precision is half the bytes (issue 25 item 6): `--dtype float16` bundles store F16 weights,
bfloat16 torch programs compile to BF16 bundles, and the reference backend computes bf16 as the
kernels do (each op in float32 on bf16 operands, rounded to nearest even on store; bf16 matmuls
accumulate in float32 and round once)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tvm")
pytestmark = pytest.mark.tvm


def st_header(bundle: Path) -> dict:
    with open(bundle / "params.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    return head


def quiet(source: str, **kw):
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    return export(source, progress=Progress(stream=None), **kw)


def test_float16_bundle_stores_f16_weights_at_half_the_bytes(tmp_path):
    from tvmpipe.bundle import load_bundle

    f32 = quiet("mlp").write(tmp_path / "f32")
    f16 = quiet("mlp", dtype="float16").write(tmp_path / "f16")
    h32, h16 = st_header(f32), st_header(f16)
    assert set(h32) == set(h16) and {t["dtype"] for t in h16.values()} == {"F16"}
    size = lambda h: sum(t["data_offsets"][1] - t["data_offsets"][0] for t in h.values())  # noqa: E731
    assert size(h16) * 2 == size(h32)
    b32, b16 = load_bundle(f32), load_bundle(f16)
    for name in h16:  # the same weights, rounded once
        assert b16.params[name].dtype == np.float16
        np.testing.assert_array_equal(b16.params[name], b32.params[name].astype(np.float16))
    # every matmul takes fp16 operands, accumulates in float32 and is rounded once, as cuBLAS runs it
    recs = [r for f in b16.ops.values() for r in f.ops]
    matmuls = [i for i, r in enumerate(recs) if r.op == "matmul"]
    assert matmuls and all(recs[i].input_dtypes == ["float16", "float16"] and recs[i].output_dtypes == ["float32"]
                           for i in matmuls)
    assert not [r for r in recs if r.output_dtypes and r.output_dtypes[-1] == "float32" and r.op != "matmul"
                and r.op != "astype"], "only the accumulators are float32"


class Block:
    """A pre-norm transformer block (attention as matmul/softmax, GELU FFN), built in torch."""

    @staticmethod
    def module(dtype):
        import torch

        class B(torch.nn.Module):
            def __init__(self, d=64, heads=4, ffn=256):
                super().__init__()
                self.h, self.dh = heads, d // heads
                self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
                self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
                self.up, self.down = torch.nn.Linear(d, ffn), torch.nn.Linear(ffn, d)

            def forward(self, x):
                n, t, d = x.shape
                q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
                q, k, v = (z.reshape(n, t, self.h, self.dh).transpose(1, 2) for z in (q, k, v))
                att = torch.softmax(q @ k.transpose(-1, -2) * self.dh ** -0.5, dim=-1)
                x = x + self.out((att @ v).transpose(1, 2).reshape(n, t, d))
                return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))

        torch.manual_seed(0)
        return B().to(dtype).eval()


def test_bfloat16_block_compiles_to_bf16_bundle_and_reference_matches_torch(tmp_path):
    """Tolerance: bf16 keeps 8 significant bits, so one rounding is up to 2^-9 relative. The bundle
    and torch round at different places (torch's addmm adds the bias before rounding, its softmax
    and layer_norm round once at the end; the graph rounds after each op), so results differ by a
    few bf16 ulps of the output's scale: 2% of max|torch| is ~5 ulps at the top binade. Measured:
    0.4-0.8% here; a wrong op or a float32/bf16 mix-up gives O(1)."""
    import ml_dtypes
    import torch

    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor import GraphRunner

    m = Block.module(torch.bfloat16)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    torch.export.save(torch.export.export(m, (x,)), str(tmp_path / "block.pt2"))
    ex = quiet(str(tmp_path / "block.pt2"))
    assert ex.dtype == "bfloat16" and ex.input_dtypes == ["bfloat16"]
    b = load_bundle(ex.write(tmp_path / "bundle"))
    head = st_header(tmp_path / "bundle")
    big = {n: t for n, t in head.items() if "ln" not in n}
    assert big and {t["dtype"] for t in big.values()} == {"BF16"}, head  # layer norms' scales stay float32
    w = b.params["p_qkv_weight_permute_dims"]  # pre-transposed, and the torch bf16 values exactly
    assert w.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(w.view(np.int16), m.qkv.weight.detach().T.contiguous().view(torch.int16).numpy())
    with torch.no_grad():
        want = m(x).float().numpy()
    r = GraphRunner(b, backend="reference")
    r.set_input(x=x.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    r.run()
    got = r.get_output(0)
    assert got.dtype == ml_dtypes.bfloat16
    err = np.abs(got.astype(np.float32) - want).max() / np.abs(want).max()
    assert err <= 2e-2, err


def test_reference_rounds_bf16_per_op_to_nearest_even():
    """An add of bf16 operands is computed in float32 and rounded once (ties to even), as the kernel's
    nv_bfloat16 `+` is; NumPy's own bf16 add would be the same here, the point is the recorded path."""
    import ml_dtypes

    from tvmpipe.bundle.manifests import parse_ops
    from tvmpipe.executor.reference_ops import run_function

    problems: list = []
    fn = parse_ops({"version": 1, "functions": {"f": {
        "num_inputs": 2, "num_outputs": 1, "outputs": [{"op": 0}],
        "ops": [{"op": "add", "inputs": [{"arg": 0}, {"arg": 1}], "attrs": {},
                 "input_shapes": [[3], [3]], "input_dtypes": ["bfloat16", "bfloat16"],
                 "output_shapes": [[3]], "output_dtypes": ["bfloat16"]}]}}}, problems)["f"]
    assert not problems, problems
    bf = ml_dtypes.bfloat16
    a = np.array([1.0, 1.0, 256.0], bf)
    b = np.array([2 ** -8, 3 * 2 ** -9, 1.0], bf)  # a tie (to even: 1.0), above a tie (up), a tie at 256
    (out,) = run_function(fn, [a, b])
    assert out.dtype == bf
    np.testing.assert_array_equal(out.astype(np.float32), [1.0, 1.0078125, 256.0])


def test_float16_torch_program_compiles_to_an_f16_bundle(tmp_path):
    """A torch program in float16 imports (re-exported in float32 over placeholder parameters, as
    bf16 is) and compiles to a float16 bundle holding torch's own fp16 weights, pre-transposed."""
    import torch

    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor import GraphRunner

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32)).half().eval()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).half()
    torch.export.save(torch.export.export(m, (x,)), str(tmp_path / "mlp16.pt2"))
    ex = quiet(str(tmp_path / "mlp16.pt2"))
    assert ex.dtype == "float16" and ex.input_dtypes == ["float16"]
    b = load_bundle(ex.write(tmp_path / "bundle"))
    assert {t["dtype"] for t in st_header(tmp_path / "bundle").values()} == {"F16"}
    np.testing.assert_array_equal(b.params["p_0_weight_permute_dims"], m[0].weight.detach().T.numpy())
    r = GraphRunner(b, backend="reference")
    r.set_input(**{b.input_names[0]: x.numpy()})
    r.run()
    with torch.no_grad():
        want = m.float()(x.float()).numpy()
    assert np.abs(r.get_output(0).astype(np.float32) - want).max() <= 2e-2 * np.abs(want).max()
