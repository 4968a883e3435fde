"""tvmpipe.cluster: run a bundle as a pipeline of stage workers, on Ray or in local processes.

    from tvmpipe.cluster.driver import Pipeline
    with Pipeline("examples/mlp", 2, launcher="ray") as pipe:    # after ray.init(), or launcher="process"
        outputs = pipe.run([{"x": x0}, {"x": x1}])

Modules: frames (wire format), transport (sockets), topology (edges), worker (StageWorker),
launch (launchers, process workers), actor (StageActor, RayLauncher), placement, driver
(Pipeline), metrics, timeline, reference (single-process oracle), local (loopback Ray), cli.
Nothing is imported here, so `tvmpipe --help` does not pay for the layer.
"""
