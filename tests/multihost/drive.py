"""The driver program the multi-host tests run on the bed's head host (`python drive.py CONFIG_JSON`).

It joins the bed's Ray cluster (RAY_ADDRESS), starts a Pipeline with the data plane on each node's
own address (host=None), and streams micro-batches, reporting on stdout one JSON line per event so
the test (outside the namespaces) can act at the right moment and measure:

  {"event": "ready", "addresses": [[host, port], ...]}   every stage's listener, then the driver's
  {"event": "output", "seq": i, "t": wall time}           micro-batch i's outputs arrived
  {"event": "end", "restarts": [...], "errors": [...], "error": null | {...}, "addresses": [...],
   "paths": [[producer, consumer, "shm" | "tcp"], ...]}   (-1: the driver)

With "hold" it waits for a line on stdin after "ready" (the test inspects sockets meanwhile).
"pace_s" spaces submissions so a fault lands mid-run. Outputs go to "out" (npz: output<k> stacked).
The clock is the machine's: the test and this process share it, so fault-to-output times are exact.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import ray

from tvmpipe.bundle import load_bundle
from tvmpipe.cluster.driver import Pipeline, PipelineError
from tvmpipe.cluster.control.launchers import Timeouts
from tvmpipe.cluster.control.placement import Placement
from tvmpipe.executor.inputs import random_micro_batches


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def main(cfg: dict) -> None:
    ray.init(log_to_driver=False, configure_logging=False)
    bundle = load_bundle(cfg["bundle"])
    batches = random_micro_batches(bundle, cfg["n"], cfg.get("seed", 0))
    placement = Placement(strategy=cfg.get("placement", "STRICT_SPREAD"), gpus=cfg.get("gpus", 1.0),
                          cpus=cfg.get("cpus", 0.5))
    timeouts = Timeouts(**cfg.get("timeouts", {}))
    outputs: list[list[np.ndarray]] = []
    error = None
    with Pipeline(bundle, cfg["stages"], backend="reference", host=None, placement=placement,
                  ship_bundle=cfg.get("ship", True), timeouts=timeouts, window=cfg.get("window"),
                  max_restarts=cfg.get("max_restarts", 3), transport=cfg.get("transport", "auto")) as pipe:
        say(event="ready", addresses=[list(a) for a in pipe.addresses])
        if cfg.get("hold"):
            sys.stdin.readline()

        def take() -> None:
            outputs.append(pipe.get())
            say(event="output", seq=len(outputs) - 1, t=time.time())

        try:
            for mb in batches:
                pipe.submit(mb)
                while pipe.ready:
                    take()
                time.sleep(cfg.get("pace_s", 0.0))
            while len(outputs) < len(batches):
                take()
        except PipelineError as exc:
            outputs += exc.completed
            error = {"message": str(exc), "stage": exc.stage, "last_error": exc.last_error}
        restarts, errors, addresses = list(pipe.restarts), list(pipe.errors), [list(a) for a in pipe.addresses]
        paths = [[src, dst, path] for (src, dst), path in sorted(pipe.edge_paths().items())]
        weights = []  # per stage: where it ran, the bytes shipped to it, read by it, resident in it
        if cfg.get("weights"):
            for st in pipe.launcher.call_all("stats"):
                weights.append(None if isinstance(st, Exception) else
                               {"host": st.host, "shipped": st.shipped_bytes, "read": st.weights_read,
                                "resident": st.weight_bytes})
        shipped = dict(getattr(pipe.launcher, "shipped", {}))
    if outputs:
        np.savez(cfg["out"], **{f"output{k}": np.stack([o[k] for o in outputs]) for k in range(len(outputs[0]))})
    say(event="end", completed=len(outputs), restarts=restarts, errors=errors, error=error, addresses=addresses,
        weights=weights, shipped=shipped, paths=paths)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
