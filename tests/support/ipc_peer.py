"""A second process for the fake driver's CUDA IPC tests: runs Python statements sent one per line
on stdin (with the fake `pycuda.driver` as `drv`, a context current, a stream `s`) and answers each
with one JSON line: {"ok": value} (the value of `result`, if set) or {"err": "Class: message"}."""

from __future__ import annotations

import json
import sys

import pycuda.driver as drv  # the fake: the parent puts tests/fakecuda first on PYTHONPATH

drv.init()
ctx = drv.Device(0).retain_primary_context()
ctx.push()
ns = {"drv": drv, "s": drv.Stream(), "np": __import__("numpy")}
for line in sys.stdin:
    ns.pop("result", None)
    try:
        exec(json.loads(line), ns)
        out = {"ok": ns.get("result")}
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out = {"err": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
