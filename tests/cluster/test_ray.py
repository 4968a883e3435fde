"""The pipeline on Ray actors: one loopback-only session cluster (conftest.ray_cluster)."""

from __future__ import annotations

import os
import threading

import pytest
from tests.support.pipeline_harness import (alive, assert_bit_identical, case, cmdline, descendants, listening_ports,
                                           local_run, niceness, record_ports, tcp_sockets)

from tvmpipe.bundle import load_bundle
from tvmpipe.cluster.driver import Pipeline
from tvmpipe.cluster.control.local import AGENT_NICENESS
from tvmpipe.cluster.control.launchers import Timeouts
from tvmpipe.cluster.control.placement import Placement, PlacementError
from tvmpipe.partition import plan_equal_ops

pytestmark = pytest.mark.ray
SMALL = Placement(cpus=0.25)


def actor_states(ray) -> dict[str, str]:
    from ray._private.state import state

    return {aid: info["State"] for aid, info in state.actor_table(None).items()}


@pytest.mark.parametrize("model", ["mlp", "cnn", "skipnet"])
def test_pipelined_equals_single_process_for_1_to_4_stages(ray_cluster, bundles, model):
    inputs, want = case(bundles[model], 10)
    n_ops = len(load_bundle(bundles[model]).graph.op_nodes)
    for k in range(1, min(4, n_ops) + 1):
        with Pipeline(bundles[model], k, launcher="ray", placement=SMALL, ship_bundle=(k == 2)) as pipe:
            record_ports(pipe)
            assert_bit_identical(pipe.run(inputs), want)
            m = pipe.metrics()
            assert [s.micro_batches for s in m.stages] == [10] * k
            assert all(s.host == "127.0.0.1" for s in m.stages)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_same_node_actors_use_shared_memory_by_ray_node_id(ray_cluster, bundles, model):
    """On one Ray node every actor reports the same Ray node id: with transport="shm" every data
    edge (the driver's too) takes shared memory, with "tcp" none does, and both give the outputs of
    one process; no segment of either run is left."""
    from tvmpipe.cluster.wire import shm

    inputs, want = case(bundles[model], 8)
    for transport in ("shm", "tcp"):
        with Pipeline(bundles[model], 3, launcher="ray", placement=SMALL, transport=transport) as pipe:
            record_ports(pipe)
            assert_bit_identical(pipe.run(inputs), want)
            assert set(pipe.edge_paths().values()) == {transport}
            assert len(set(pipe._nodes)) == 1 and pipe._nodes[0].ray is not None
            run = pipe.run_id
        assert shm.segment_names(run) == []


def test_two_pipelines_with_the_same_stage_count_share_a_cluster(ray_cluster, bundles):
    """Two jobs on one cluster: their placement groups must not collide by name."""
    inputs, want = case(bundles["mlp"], 4)
    with Pipeline(bundles["mlp"], 2, launcher="ray", placement=SMALL) as a, \
            Pipeline(bundles["mlp"], 2, launcher="ray", placement=SMALL) as b:
        record_ports(a)
        record_ports(b)
        assert_bit_identical(a.run(inputs), want)
        assert_bit_identical(b.run(inputs), want)


def test_kill_a_stage_actor_mid_run(ray_cluster, bundles):
    """ray.kill on stage 1 while 200 micro-batches stream: 200 outputs, each once, in order, equal
    to a clean run; the replacement actor is new, the others are the same."""
    ray = ray_cluster
    inputs, want = case(bundles["mlp"], 200)
    with Pipeline(bundles["mlp"], 3, launcher="ray", placement=SMALL, window=6,
                  timeouts=Timeouts(progress=30)) as pipe:
        record_ports(pipe)
        pids = [s.pid for s in pipe.status()]
        got = []
        for i, x in enumerate(inputs):
            pipe.submit(x)
            if i == 80:
                ray.kill(pipe.launcher.actor(1), no_restart=True)
            while pipe.ready:
                got.append(pipe.get())
        got += list(pipe.results())
        assert pipe.restarts == [0, 1, 0]
        new = [s.pid for s in pipe.status()]
    assert_bit_identical(got, want)
    assert new[0] == pids[0] and new[2] == pids[2] and new[1] != pids[1]


def test_everything_stays_on_loopback_and_nothing_survives_close(ray_cluster, bundles):
    ray = ray_cluster
    inputs, want = case(bundles["skipnet"], 40)
    before = actor_states(ray)
    pipe = Pipeline(bundles["skipnet"], 3, launcher="ray", placement=SMALL)
    record_ports(pipe)
    seen: list[tuple[int, str]] = []
    ours = descendants(os.getpid()) | {os.getpid()}
    done = threading.Event()

    def watch():  # sample every socket of this process tree while frames are flowing
        while not done.is_set():
            seen.extend(tcp_sockets(ours))
            done.wait(0.05)

    t = threading.Thread(target=watch)
    t.start()
    try:
        assert_bit_identical(pipe.run(inputs), want)
    finally:
        done.set()
        t.join()
    worker_pids = [s.pid for s in pipe.status()]
    ports = {p for _, p in pipe.addresses}
    assert ports <= listening_ports()
    pipe.close()
    hosts = {addr.rsplit(":", 1)[0].removeprefix("[::ffff:").rstrip("]") for _, addr in seen}
    assert hosts == {"127.0.0.1"}, sorted({a for _, a in seen})
    new = {a: s for a, s in actor_states(ray).items() if a not in before}
    assert len(new) == 3 and set(new.values()) == {"DEAD"}
    assert not ports & listening_ports()
    from ray.util import placement_group_table

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
    for _ in range(50):  # actor processes exit asynchronously after ray.kill
        if not any(alive(p) for p in worker_pids):
            break
        threading.Event().wait(0.1)
    assert not any(alive(p) for p in worker_pids)


def test_fractional_gpus_and_node_pinning(ray_cluster, bundles):
    """Four stages share the two (fake) GPUs at 0.5 each; every stage is pinned to this node."""
    inputs, want = case(bundles["tiny"], 4)
    placement = Placement(strategy="PACK", gpus=0.5, cpus=0.25, nodes=("127.0.0.1",) * 3)
    with Pipeline(bundles["tiny"], 3, launcher="ray", placement=placement) as pipe:
        assert_bit_identical(pipe.run(inputs), want)
        devices = [st.devices for st in pipe.launcher.call_all("stats")]
    assert all(d in ("0", "1") for d in devices), devices


@pytest.mark.parametrize("strategy", ["SPREAD", "STRICT_PACK"])
def test_soft_strategies_fit_one_node(ray_cluster, bundles, strategy):
    inputs, want = case(bundles["tiny"], 3)
    with Pipeline(bundles["tiny"], 2, launcher="ray", placement=Placement(strategy=strategy, cpus=0.25)) as pipe:
        assert_bit_identical(pipe.run(inputs), want)


def test_strict_spread_needs_a_node_per_stage(ray_cluster, bundles, caplog):
    """On a cluster that may grow, an infeasible reservation waits out the start timeout, saying
    once in the log what it waits for."""
    with caplog.at_level("WARNING", logger="tvmpipe.cluster.control.placement"):
        with pytest.raises(PlacementError, match="STRICT_SPREAD .*not reserved within 2 s"):
            Pipeline(bundles["tiny"], 2, launcher="ray", placement=Placement(strategy="STRICT_SPREAD", cpus=0.25),
                     timeouts=Timeouts(start=2))
    waits = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert len(waits) == 1 and "2 stages with STRICT_SPREAD" in waits[0], waits


@pytest.mark.parametrize("placement", [Placement(strategy="STRICT_SPREAD", cpus=0.25, grows=False),
                                       Placement(gpus=8.0, cpus=0.25, grows=False)])
def test_an_infeasible_placement_fails_at_once_where_no_node_can_join(ray_cluster, bundles, placement):
    """More stages than nodes under STRICT_SPREAD, or a slot bigger than any node: Ray keeps such a
    reservation pending for ever, and the run waited out its 300 s start timeout in silence. A
    cluster that cannot grow (the embedded --local head) refuses it as soon as Ray calls it
    infeasible, naming the strategy, the slot and what the cluster has."""
    import time

    t0 = time.monotonic()
    with pytest.raises(PlacementError) as info:
        Pipeline(bundles["tiny"], 2, launcher="ray", placement=placement, timeouts=Timeouts(start=300))
    assert time.monotonic() - t0 < 60
    message = str(info.value)
    assert "cannot hold it" in message and placement.strategy in message and "nodes" in message
    assert "\n" not in message


def test_a_stage_that_reserves_no_cpu_still_gets_a_slot(ray_cluster, bundles):
    """--cpus-per-stage 0 without GPUs left each slot empty, which Ray's placement_group() refuses
    (a ValueError traceback); the slot now holds Ray's smallest CPU grain."""
    inputs, want = case(bundles["tiny"], 3)
    with Pipeline(bundles["tiny"], 2, launcher="ray", placement=Placement(cpus=0.0)) as pipe:
        assert_bit_identical(pipe.run(inputs), want)


def test_prediction_bounds_the_measured_pipeline(ray_cluster, bundles):
    """Simulated backend with a per-node profile that both the planner and the stages read, on Ray.
    What holds on a machine under any load (how close the prediction comes is measured with its spread
    in bench/predict.py, not timed here): stages that sleep their op times cannot beat the model's
    period, each stage computes at least its predicted time, and the stage the model names as the
    bottleneck is the one the workers measure busiest, busy through the steady state (a pipeline that
    serialised its stages would leave it ~55 % busy)."""
    from tvmpipe.partition.model import PipelineModel
    from tvmpipe.partition.predict import predict

    b = load_bundle(bundles["skipnet"])
    ops = list(b.graph.op_nodes)
    slow = set(ops[3:6])  # equal plan of 8 ops: [3, 3, 2] -> 7.5, 15 and 5 ms per stage
    profile = {"nodes": [{"node": n, "name": b.graph.nodes[n].name, "time_us": 5000.0 if n in slow else 2500.0}
                         for n in ops]}
    plan = plan_equal_ops(b.graph, 3)
    predicted = predict(PipelineModel.build(b, profile=profile), plan)
    assert [s.compute_us for s in predicted.stages] == [7500.0, 15000.0, 5000.0]
    inputs = case(bundles["skipnet"], 40)[0]
    with Pipeline(b, plan, launcher="ray", placement=SMALL, backend="simulated",
                  backend_opts={"cost_profile": profile}) as pipe:
        pipe.run(inputs)
        m = pipe.metrics()
    measured = m.steady_throughput * m.batch
    assert measured <= predicted.throughput * 1.02, (measured, predicted.throughput)
    for st, want in zip(m.stages, predicted.stages):
        assert st.compute_ms_mean * 1e3 >= want.compute_us * 0.99, (st.stage, st.compute_ms_mean)
    busiest = max(m.stages, key=lambda st: st.compute_ms_mean)
    assert busiest.stage == 1 and busiest.busy > 0.8, [(st.stage, st.busy) for st in m.stages]


# what the daemons local mode leaves out run as (local.LEAN_HEAD_SKIPS): the API server, the
# autoscaler monitor, the log monitor
LEFT_OUT_DAEMONS = ("dashboard/dashboard.py", "autoscaler/_private/monitor.py", "_private/log_monitor.py")


def test_lean_head_changes_ray_only_inside_its_block():
    """The patches on Ray are scoped: a head started later (a user's own ray.init in the same
    process) gets every daemon, the full dashboard agent and un-niced agents again."""
    from ray._private import node, ray_constants, services, utils
    from tvmpipe.cluster.control.local import LEAN_HEAD_SKIPS, lean_head

    before = {name: getattr(node.Node, name) for name in LEAN_HEAD_SKIPS}
    patched = (utils.get_dashboard_dependency_error, services._build_python_executable_command_memory_profileable,
               services.get_node)
    plain = services._build_python_executable_command_memory_profileable(ray_constants.PROCESS_TYPE_DASHBOARD_AGENT, "/s")
    start_process = services.start_ray_process
    with lean_head() as changed:
        assert changed == [*LEAN_HEAD_SKIPS, "minimal agent", "niced agents", "node poll"]  # Ray 2.60 has them all
        assert services.start_ray_process is start_process  # no count given: Ray's own prestart
    with lean_head(workers=3) as changed:
        assert changed[-1] == "prestart 3" and services.start_ray_process is not start_process
    assert services.start_ray_process is start_process
    with lean_head() as changed:
        for name in LEAN_HEAD_SKIPS:
            assert getattr(node.Node, name) is not before[name]
            assert getattr(node.Node, name)(object()) is None
        assert utils.get_dashboard_dependency_error() is not None  # Ray then starts the agent --minimal
        build = services._build_python_executable_command_memory_profileable
        for agent in (ray_constants.PROCESS_TYPE_DASHBOARD_AGENT, ray_constants.PROCESS_TYPE_RUNTIME_ENV_AGENT):
            cmd = build(agent, "/s")
            assert os.path.basename(cmd[0]) == "nice" and cmd[1:3] == ["-n", str(AGENT_NICENESS)] and cmd[3:] == plain
        assert build(ray_constants.PROCESS_TYPE_WORKER, "/s") == plain  # workers (stages) are not niced
    assert {name: getattr(node.Node, name) for name in LEAN_HEAD_SKIPS} == before
    assert (utils.get_dashboard_dependency_error, services._build_python_executable_command_memory_profileable,
            services.get_node) == patched
    assert services._build_python_executable_command_memory_profileable(
        ray_constants.PROCESS_TYPE_DASHBOARD_AGENT, "/s") == plain


def test_the_raylet_prestarts_the_given_count_of_workers():
    """Ray's raylet is told to prestart int(num_cpus) workers; the local head replaces that one flag."""
    from tvmpipe.cluster.control.local import PRESTART_FLAG, prestarting

    cmd = ["raylet", "--node_ip_address=127.0.0.1", f"{PRESTART_FLAG}2", "--maximum_startup_concurrency=2"]
    assert prestarting(cmd, 1) == ["raylet", "--node_ip_address=127.0.0.1", f"{PRESTART_FLAG}1",
                                   "--maximum_startup_concurrency=2"]
    assert prestarting(["raylet"], 4) == ["raylet"]  # a Ray without the flag: unchanged


def ray_workers(lines: list[str]) -> list[str]:
    """The Ray worker processes among command lines: booting (python .../default_worker.py) or
    retitled (ray::IDLE, ray::StageActor...); the two agents retitle themselves too."""
    return [c for c in lines if (len(c.split()) > 1 and c.split()[1].endswith("default_worker.py")) or
            (c.startswith("ray::") and not c.startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent")))]


def test_a_local_run_starts_one_ray_worker_per_stage():
    """`tvmpipe run --local --stages 1` on this 2-CPU cluster (num_cpus 2): Ray alone would prestart two
    workers, and one would idle through the run (0.35 CPU-s and 78 MB while the stage boots); the
    local head prestarts exactly the stage's."""
    import time

    driver = local_run(1, lambda lines: any("StageActor" in c for c in ray_workers(lines)))  # mid-run
    try:
        time.sleep(1.0)  # a prestarted worker registers within a second of the stage's
        workers = ray_workers([cmdline(p) for p in descendants(driver.pid)])
        assert len(workers) == 1 and "StageActor" in workers[0], workers
    finally:
        driver.terminate()
        driver.wait(timeout=60)


def test_the_head_asks_for_its_raylet_once_the_node_table_lists_it(monkeypatch):
    """Ray's accessor retries get_node only every second; the embedded head polls the node table
    (every 20 ms) until its raylet is alive there, and only then calls Ray's get_node, once."""
    from ray._private import services, state
    from tvmpipe.cluster.control import local

    calls: list = []

    class Table:  # GlobalState, as far as _wait_for_node uses it
        def _initialize_global_state(self, options):
            calls.append(("connect", options))

        def node_table(self):
            calls.append("table")
            return [{"NodeID": "other", "Alive": True}, {"NodeID": "n1", "Alive": calls.count("table") > 3}]

        def disconnect(self):
            calls.append("disconnect")

    monkeypatch.setattr(state, "GlobalState", Table)
    monkeypatch.setattr(services, "_get_gcs_client_options", lambda address: f"options for {address}")
    got = local._wait_for_node(lambda a, n: calls.append(("get_node", a, n)) or "node info", "127.0.0.1:1", "n1")
    assert got == "node info"
    assert calls == [("connect", "options for 127.0.0.1:1"), *["table"] * 4, "disconnect", ("get_node", "127.0.0.1:1", "n1")]


def test_ray_daemons_never_ask_the_cloud_metadata_address(ray_cluster):
    """Ray's API server (started even without the dashboard) asks 169.254.169.254 which cloud it is
    on unless ~/ray_bootstrap_config.yaml exists. Local mode starts no API server at all (nor the
    autoscaler and log monitors it has no use for), and, should a Ray version start one anyway,
    starts the daemons with a private HOME holding that file. Workers inherit it, with user
    site-packages and tvmpipe's cache pinned to the user's own; the driver's environment is
    restored."""
    import site

    ray = ray_cluster
    procs = {p: cmdline(p) for p in descendants(os.getpid())}
    assert not [(p, c[:120]) for p, c in procs.items() if any(d in c for d in LEFT_OUT_DAEMONS)]
    daemons = [p for p, c in procs.items() if "gcs_server" in c.split(" ", 1)[0] or "raylet" in c.split(" ", 1)[0]]
    assert len(daemons) == 2, procs
    # the two agents run niced (they retitle themselves), the dashboard agent minimal (the raylet
    # starts it with the command it was given); the daemons are not niced
    agents = [p for p, c in procs.items() if c.startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent"))]
    assert len(agents) == 2 and {niceness(p) for p in agents} == {AGENT_NICENESS}, procs
    assert {niceness(p) for p in daemons} == {os.getpriority(os.PRIO_PROCESS, 0)}
    raylet = next(c for p, c in procs.items() if "raylet" in c.split(" ", 1)[0])
    assert "dashboard/agent.py" in raylet and "--minimal" in raylet
    for pid in daemons:
        env = dict(kv.split(b"=", 1) for kv in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in kv)
        home = env[b"HOME"].decode()
        assert home != os.environ["HOME"] and os.path.isfile(os.path.join(home, "ray_bootstrap_config.yaml"))

    @ray.remote(num_cpus=0.1)
    def worker_env():
        return os.environ.get("PYTHONUSERBASE"), os.environ.get("TVMPIPE_CACHE")

    userbase, cache = ray.get(worker_env.remote(), timeout=60)
    assert userbase == site.getuserbase()
    assert cache == os.environ.get("TVMPIPE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tvmpipe"))
    assert os.path.expanduser("~") != home



def test_stage_actors_inherit_the_thread_counts_instead_of_a_runtime_env(ray_cluster, bundles):
    """A runtime_env costs ~0.6 s per actor (no prestarted worker; Ray's runtime-env agent first):
    the local cluster starts its daemons with the BLAS thread counts, so stage actors are created
    without one and compute with them all the same; what workers lack (an extra variable) still
    goes through a runtime_env."""
    from tvmpipe.cluster.control.ray_actors import RayLauncher
    from tvmpipe.cluster.control.environment import THREAD_VARS, missing_from_workers, thread_env

    ray = ray_cluster
    assert missing_from_workers(thread_env()) == {}
    changed = {THREAD_VARS[0]: str(int(thread_env()[THREAD_VARS[0]]) + 1), "TVMPIPE_TEST_EXTRA": "1"}
    assert missing_from_workers({**thread_env(), **changed}) == changed

    @ray.remote(num_cpus=0.1)
    def worker_threads():
        return {k: os.environ.get(k) for k in THREAD_VARS}

    assert ray.get(worker_threads.remote(), timeout=60) == thread_env()

    class Spy:  # the actor class, recording what each actor was created with
        def __init__(self, remote):
            self.remote, self.options_seen = remote, []

        def options(self, **kw):
            self.options_seen.append(kw)
            return self.remote.options(**kw)

    inputs, want = case(bundles["mlp"], 3)
    for env, expect in (({}, None), ({"TVMPIPE_TEST_EXTRA": "1"}, {"env_vars": {"TVMPIPE_TEST_EXTRA": "1"}})):
        launcher = RayLauncher(SMALL, env=env)
        launcher._remote = spy = Spy(launcher._remote)
        with Pipeline(bundles["mlp"], 2, launcher=launcher) as pipe:
            record_ports(pipe)
            assert_bit_identical(pipe.run(inputs), want)
        assert [kw.get("runtime_env") for kw in spy.options_seen] == [expect, expect]
