"""A multi-host network on one machine: Linux network namespaces joined by a bridge.

Each *host* is a network namespace with its own loopback and one veth interface holding a private
address from SUBNET. The bridge lives in a namespace of its own (the *switch*), so nothing at all is
created in the machine's own namespace: no interface, no route, no address. Deleting the namespaces
deletes every interface with them, and `ip netns pids` lists exactly the processes that run on a
host, so teardown ends only what this bed started and can prove that nothing is left.

Traffic never leaves the bed: a host's only non-loopback interface is its veth to the switch, which
has no uplink, and no host has a default route. Other test sessions on the machine cannot clash with
it either: ports and addresses are per namespace, and namespace names carry a unique tag.

Needs root and iproute2 (`ip`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field

from tests.support.local_ray_head import terminate

SUBNET = "10.213.77"  # /24, private (RFC 1918); only ever inside the bed's own namespaces
PREFIX = "tvmp"  # every namespace this module creates starts with it (leak checks look for it)


def available() -> str | None:
    """Why a bed cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def namespaces() -> list[str]:
    """Every network namespace name on the machine."""
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def sweep_orphans() -> list[str]:
    """Remove beds whose creating process is gone (a test run killed with SIGKILL cannot tear down).
    A bed's tag holds its creator's pid; beds of live processes (other sessions) are left alone."""
    removed = []
    for name in namespaces():
        m = re.fullmatch(rf"{PREFIX}(\d+)x[0-9a-f]+-(sw|h\d+)", name)
        if not m or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        Host(name, "", "", "").kill_all()
        ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


@dataclass
class Host:
    name: str  # its namespace
    address: str  # its one address on the bridge
    interface: str  # the veth inside the namespace
    port: str  # the veth's peer, on the switch

    def pids(self) -> list[int]:
        """Every process running in this host's namespace."""
        out = ip("netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]

    def command(self, *argv: str) -> list[str]:
        """argv run on this host."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, *argv: str, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 120)
        return subprocess.run(self.command(*argv), **kw)

    def sockets(self, *flags: str) -> list[list[str]]:
        """`ss -Hn FLAGS` inside the host, split into columns."""
        out = self.run("ss", "-Hn", *flags, check=True).stdout
        return [line.split() for line in out.splitlines() if line.strip()]

    def link(self, up: bool) -> None:
        """Plug or unplug the host's cable (its veth; the peer on the switch follows)."""
        ip("-n", self.name, "link", "set", self.interface, "up" if up else "down")

    def kill_all(self, sig: int = signal.SIGKILL, wait: float = 0.0) -> list[int]:
        """Signal every process on the host (a host crash), waiting up to `wait` s for them to be
        gone; return the pids signalled."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while self.pids() and time.time() < deadline:
            time.sleep(0.1)
        return pids


@dataclass
class NetBed:
    """`n` hosts on one bridge: hosts[i] has address SUBNET.(i+1). Use as a context manager."""

    n: int = 4
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}x{uuid.uuid4().hex[:4]}")
    hosts: list[Host] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def names(self) -> list[str]:
        return [self.switch] + [f"{self.tag}-h{i}" for i in range(self.n)]

    def up(self) -> NetBed:
        try:
            ip("netns", "add", self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.n):
                h = Host(f"{self.tag}-h{i}", f"{SUBNET}.{i + 1}", f"eth{i}", f"port{i}")
                ip("netns", "add", h.name)
                self.hosts.append(h)
                ip("-n", h.name, "link", "set", "lo", "up")
                ip("link", "add", h.interface, "netns", h.name, "type", "veth", "peer", "name", h.port,
                   "netns", self.switch)
                ip("-n", self.switch, "link", "set", h.port, "master", "br0")
                ip("-n", self.switch, "link", "set", h.port, "up")
                ip("-n", h.name, "addr", "add", f"{h.address}/24", "dev", h.interface)
                ip("-n", h.name, "link", "set", h.interface, "up")
        except BaseException:
            self.down()
            raise
        return self

    def down(self, grace: float = 3.0) -> list[str]:
        """Stop every process on every host (SIGTERM, then SIGKILL), delete the namespaces (and with
        them every interface). Returns what could not be removed (empty when clean)."""
        mine = list(self.hosts)
        terminate(lambda: [p for h in mine for p in h.pids()], grace)
        left = [f"process {p} on {h.name}" for h in mine for p in h.pids()]
        existing = set(namespaces())
        for name in self.names():
            if name in existing:
                ip("netns", "del", name, check=False)
        left += [f"namespace {n}" for n in self.leftovers()]
        return left

    def leftovers(self) -> list[str]:
        """Namespaces of this bed that still exist."""
        return [n for n in namespaces() if n.startswith(self.tag + "-")]

    def __enter__(self) -> NetBed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        left = self.down()
        if left:
            raise RuntimeError(f"the network test bed left behind: {', '.join(left)}")
