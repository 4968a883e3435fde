"""The test bed itself: hosts reach each other over the bridge and nothing else; tearing it down,
also when the test inside fails, leaves no namespace, interface, process or socket behind; a bed
whose creator was killed (SIGKILL: no teardown ran) is swept by the next run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.pipeline_harness import alive
from netbed import PREFIX, NetBed, ip, namespaces, sweep_orphans

LISTEN = "import socket,time; s=socket.create_server(('{}',7000)); print('up',flush=True); time.sleep(300)"


def _root_view() -> tuple[str, str]:
    """The machine's own interfaces and sockets: the bed must never change them."""
    links = ip("-o", "link", "show").stdout
    links = "\n".join(sorted(line.split(":", 2)[1] for line in links.splitlines()))
    socks = subprocess.run(["ss", "-Htanl"], capture_output=True, text=True).stdout
    return links, "\n".join(sorted(line.split()[3] for line in socks.splitlines() if ":7000" in line))


def test_failing_test_leaves_nothing_behind(netbed_ok):
    before = _root_view()
    procs = []
    with pytest.raises(ZeroDivisionError):
        with NetBed(3) as net:
            a, b, c = net.hosts
            server = subprocess.Popen(b.command(sys.executable, "-c", LISTEN.format(b.address)),
                                      stdout=subprocess.PIPE, text=True)
            procs.append(server)
            assert server.stdout.readline().strip() == "up"
            reach = a.run(sys.executable, "-c", f"import socket; socket.create_connection(('{b.address}',7000),2)")
            assert reach.returncode == 0, reach.stderr  # across the bridge
            routes = ip("-n", a.name, "-4", "route", "show").stdout.split("\n")
            assert [r.split()[0] for r in routes if r.strip()] == ["10.213.77.0/24"]  # no way out: no default route
            assert _root_view() == before  # nothing of the bed in the machine's own namespace
            pids = [pid for h in net.hosts for pid in h.pids()]
            assert server.pid in pids or any(alive(p) for p in pids)
            1 / 0  # the test fails while everything is up
    server.wait(timeout=10)
    assert all(not alive(p) for p in pids)
    assert not [n for n in namespaces() if n.startswith(net.tag)]
    assert _root_view() == before


def test_orphaned_bed_is_swept(netbed_ok):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # a creator that no longer exists
    net = NetBed(2, tag=f"{PREFIX}{dead_pid}x0000").up()
    sleeper = subprocess.Popen(net.hosts[1].command("sleep", "300"))
    try:
        assert set(net.names()) <= set(namespaces())
        assert set(sweep_orphans()) >= set(net.names())
        sleeper.wait(timeout=10)
        assert net.leftovers() == []
    finally:
        net.down()
        if sleeper.poll() is None:
            sleeper.kill()
