"""GraphRunner's TVM-style verbs, wrong-input rejection, params, profiling and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.tiny_bundle import tiny_expected, tiny_params
from tvmpipe.bundle.params import save_tvm_params
from tvmpipe.cli import main
from tvmpipe.executor import ExecutorError, GraphRunner, InputError, Stage, UnsupportedOpError, random_inputs


@pytest.fixture
def x():
    return np.random.default_rng(5).standard_normal((1, 4)).astype(np.float32)


def test_verbs(bundles, x):
    r = GraphRunner(bundles["tiny"])
    assert r.get_num_inputs() == 1 and r.get_num_outputs() == 1
    r.set_input("x", x)
    r.run()
    want = tiny_expected(x, tiny_params())
    np.testing.assert_allclose(r.get_output(0), want, rtol=1e-6)
    r.set_input(0, 2 * x)
    np.testing.assert_array_equal(r.get_input("x"), 2 * x)
    r.run()
    np.testing.assert_allclose(r.get_output(0), tiny_expected(2 * x, tiny_params()), rtol=1e-6)
    r.run(x=x)
    np.testing.assert_allclose(r.get_output(0), want, rtol=1e-6)
    r.set_input(x=3 * x)
    assert np.array_equal(r.get_input(0), 3 * x)


def test_set_input_copies(bundles, x):
    r = GraphRunner(bundles["tiny"])
    r.set_input("x", x)
    x_orig = x.copy()
    x[...] = 0
    r.run()
    np.testing.assert_allclose(r.get_output(0), tiny_expected(x_orig, tiny_params()), rtol=1e-6)


def test_multi_output_and_head_order(bundles):
    b = bundles["skipnet"]
    r = GraphRunner(b)
    r.run(**random_inputs(b))
    assert r.get_num_outputs() == 2
    assert r.get_output(0).shape == (8,) and r.get_output(1).shape == (16,)
    assert np.all(r.get_output(1) >= 0)  # relu output, through the __nop head
    np.testing.assert_allclose(np.exp(r.get_output(0)).sum(), 1.0, rtol=1e-5)  # log_softmax


@pytest.mark.parametrize("call,match", [
    (lambda r, x: r.set_input("y", x), r"unknown input 'y'; the graph's inputs are: x: float32\[1, 4\]"),
    (lambda r, x: r.set_input(3, x), r"input index 3 is out of range: the graph has 1 input"),
    (lambda r, x: r.set_input("x", x.astype(np.float64)), r"input 'x': expected float32\[1, 4\], got float64\[1, 4\]"),
    (lambda r, x: r.set_input("x", x.reshape(4, 1)), r"input 'x': expected float32\[1, 4\], got float32\[4, 1\]"),
    (lambda r, x: r.set_input("x", [[1.0, 2.0, 3.0, 4.0]]), r"expected a numpy array float32\[1, 4\], got list"),
    (lambda r, x: r.run(), r"input\(s\) not set: x: float32\[1, 4\]"),
    (lambda r, x: r.run(z=x), r"unknown input 'z'"),
    (lambda r, x: r.get_input("x"), r"input 'x' has not been set"),
])
def test_wrong_inputs_rejected_before_running(bundles, x, call, match):
    r = GraphRunner(bundles["tiny"])
    calls = []
    execute = r.stage.backend.execute
    r.stage.backend.execute = lambda *a, **k: calls.append(1) or execute(*a, **k)
    with pytest.raises(InputError, match=match):
        call(r, x)
    assert calls == []


def test_stage_rejects_wrong_feeds(bundles, x):
    s = Stage(bundles["tiny"], 4, 6)  # receives entry 3 (dense_relu output)
    ran = []
    s.backend.execute = lambda *a, **k: ran.append(1)
    with pytest.raises(InputError, match=r"missing entry 3 \(node 3 'dense_relu' output 0\): float32\[1, 3\]"):
        s.run({})
    with pytest.raises(InputError, match=r"does not take entry 0; it expects: entry 3 \(node 3 'dense_relu' output 0\)"):
        s.run({0: x, 3: np.zeros((1, 3), np.float32)})
    with pytest.raises(InputError, match=r"entry 3 \(node 3 'dense_relu' output 0\): expected float32\[1, 3\], got int32\[1, 3\]"):
        s.run({3: np.zeros((1, 3), np.int32)})
    assert ran == []


def test_get_output_errors(bundles):
    r = GraphRunner(bundles["tiny"])
    with pytest.raises(ExecutorError, match="call run"):
        r.get_output(0)
    r.run(x=np.zeros((1, 4), np.float32))
    with pytest.raises(ExecutorError, match="out of range"):
        r.get_output(1)


def test_load_params(bundles, x, tmp_path):
    r = GraphRunner(bundles["tiny"])
    new = tiny_params(seed=9)
    want = tiny_expected(x, new)
    for source in (new, save_tvm_params(new)):
        r2 = GraphRunner(bundles["tiny"])
        r2.load_params(source)
        r2.run(x=x)
        np.testing.assert_allclose(r2.get_output(0), want, rtol=1e-6)
    (tmp_path / "p.params").write_bytes(save_tvm_params(new))
    np.savez(tmp_path / "p.npz", **new)
    for path in (tmp_path / "p.params", str(tmp_path / "p.npz")):
        r.load_params(tiny_params(0))
        r.load_params(path)
        r.run(x=x)
        np.testing.assert_allclose(r.get_output(0), want, rtol=1e-6)
    with pytest.raises(InputError, match=r"not params of this graph: 'x'"):
        r.load_params({"x": x})
    with pytest.raises(InputError, match=r"param 'w'.*expected float32\[4, 3\], got float32\[3, 4\]"):
        r.load_params({"w": new["w"].T.copy()})


def test_profile_forms(bundles):
    b = bundles["convnet"]
    r = GraphRunner(b)
    r.set_input(**random_inputs(b))
    prof = r.profile(repeat=2)
    assert [n.node for n in prof.nodes] == r.program.op_nodes
    conv = next(n for n in prof.nodes if n.name == "conv1")
    assert conv.ops == ["nn.conv2d", "add", "nn.relu"] and conv.outputs == ["float32[1, 8, 8, 8]"]
    assert all(n.time_us >= 0 for n in prof.nodes) and prof.run_us > 0
    text = prof.table()
    assert "conv1" in text and "nn.conv2d,add,nn.relu" in text and "run() mean" in text
    js = json.loads(json.dumps(prof.to_json()))
    assert js["model"] == "convnet" and js["repeat"] == 2 and len(js["nodes"]) == len(prof.nodes)
    trace = prof.chrome_trace()
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in xs] == [n.name for n in prof.nodes]
    assert all(b["ts"] >= a["ts"] + a["dur"] - 1e-9 for a, b in zip(xs, xs[1:]))
    assert r.get_output(0).shape == (1, 5)  # profile() leaves the outputs of its last run


def test_unknown_op_is_a_load_error(tmp_path):
    from tests.support.tiny_bundle import tiny_ops, write_tiny

    ops = tiny_ops()
    ops["functions"]["fused_multiply"]["ops"][0]["op"] = "nn.frobnicate"
    b = write_tiny(tmp_path / "bad", ops=ops)
    with pytest.raises(UnsupportedOpError, match=r"op 'nn.frobnicate' in function 'fused_multiply' \(node 5 'scale'\)"):
        GraphRunner(b)
    Stage(b, 0, 4)  # a stage without that node still builds
    GraphRunner(b, backend="simulated")  # and the simulated backend needs no op implementations


def test_backend_options_checked(bundles):
    with pytest.raises(ExecutorError, match=r"backend 'reference' has no option\(s\) graphs"):
        GraphRunner(bundles["tiny"], graphs=True)
    with pytest.raises(ExecutorError, match=r"unknown backend 'tpu'"):
        GraphRunner(bundles["tiny"], backend="tpu")


def test_cli_profile(bundle_dirs, tmp_path, capsys):
    d = bundle_dirs["skipnet"]
    assert main(["profile", str(d), "--repeat", "2", "--trace", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "dense1" in out and "matmul,add,nn.relu" in out
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    np.savez(tmp_path / "in.npz", x=np.ones((1, 8), np.float32))
    assert main(["profile", str(d), "--repeat", "1", "--json", "--inputs", str(tmp_path / "in.npz")]) == 0
    prof = json.loads(capsys.readouterr().out)
    assert prof["backend"] == "reference" and prof["nodes"][0]["name"] == "dense1"
    (tmp_path / "p.json").write_text(json.dumps(prof))
    assert main(["profile", str(d), "--repeat", "1", "--backend", "simulated", "--cost-profile", str(tmp_path / "p.json")]) == 0
    assert "skipnet on simulated" in capsys.readouterr().out


def test_cli_errors_without_traceback(bundle_dirs, tmp_path, capsys):
    np.savez(tmp_path / "bad.npz", x=np.ones((2, 8), np.float32))
    assert main(["profile", str(bundle_dirs["skipnet"]), "--inputs", str(tmp_path / "bad.npz")]) == 2
    err = capsys.readouterr().err
    assert "input 'x': expected float32[1, 8], got float32[2, 8]" in err and "Traceback" not in err
    assert main(["extract", str(bundle_dirs["tiny"]), "--nodes", "3-5", "-o", str(tmp_path / "o")]) == 2
    assert "--nodes must be A:B" in capsys.readouterr().err


def test_a_head_passed_straight_through_is_the_input_the_run_saw(tmp_path, x):
    """A graph output that is an input node: get_output gives the input of the last run, even when
    set_input changed it since (outputs are copied out lazily, but this one is taken at run)."""
    from tests.support.tiny_bundle import tiny_graph, write_tiny

    graph = tiny_graph()
    graph["heads"] = [[5, 0, 0], [0, 0, 0]]
    r = GraphRunner(write_tiny(tmp_path / "echo", graph=graph))
    r.run(x=x)
    r.set_input("x", 2 * x)
    np.testing.assert_array_equal(r.get_output(1), x)
    np.testing.assert_allclose(r.get_output(0), tiny_expected(x, tiny_params()), rtol=1e-6)
    r.run()
    np.testing.assert_array_equal(r.get_output(1), 2 * x)
