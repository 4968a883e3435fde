"""Without the compile extra: the package imports, --help works, compile says how to install TVM.

Runs in subprocesses where `tvm`, `torch` and `onnx` are made unimportable.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BLOCK = "import sys\nfor m in ('tvm', 'torch', 'onnx'): sys.modules[m] = None\n"


def run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_compiler_modules_import_without_tvm():
    r = run_blocked(
        "import importlib\n"
        "for m in ('cli', 'constnames', 'cpucheck', 'errors', 'export', 'frontend', 'graphjson', 'launches',\n"
        "          'models', 'opmap', 'precision', 'progress', 'packed', 'ggufsource', 'ggufmodel', 'quantize',\n"
        "          'dequantfuse'):\n"
        "    importlib.import_module('tvmpipe.compiler.' + m)\n"
        "print(sorted(m for m in ('tvm', 'torch', 'onnx') if sys.modules.get(m) is not None))\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_help_works_without_tvm():
    r = run_blocked("from tvmpipe.cli import main\nsys.exit(main(['--help']))")
    assert r.returncode == 0, r.stderr
    assert "compile" in r.stdout
    r = run_blocked("from tvmpipe.cli import main\nsys.exit(main(['compile', '--help']))")
    assert r.returncode == 0 and "--omit-params" in r.stdout


def test_compile_without_tvm_says_how_to_install(tmp_path):
    out = tmp_path / "b"
    r = run_blocked(f"from tvmpipe.cli import main\nsys.exit(main(['compile', 'mlp', '-o', {str(out)!r}]))")
    assert r.returncode == 2
    assert "pip install -e '.[compile]'" in r.stderr and "'tvm'" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_examples_load_without_tvm():
    r = run_blocked(
        "import json\nfrom tvmpipe.bundle import load_bundle\n"
        "out = {}\n"
        "for name in ('mlp', 'cnn'):\n"
        "    b = load_bundle('examples/' + name)\n"
        "    out[name] = [b.manifest.params_seed, b.manifest.batch, b.manifest.target['arch'], len(b.params),\n"
        "                 len(b.kernels), sorted({str(p.dtype) for p in b.params.values()})]\n"
        "print(json.dumps(out))\n"
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"mlp": [0, 1, "sm_90", 8, 5, ["float32"]],
                                    "cnn": [0, 1, "sm_90", 6, 6, ["float32"]]}
