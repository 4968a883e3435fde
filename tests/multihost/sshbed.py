"""Machines for `ray up`: NetBed hosts that also have their own process table, /root and /tmp, and an
SSH server, so Ray's cluster launcher treats them exactly like separate machines.

A host's sshd runs inside `unshare --pid --mount`: everything an SSH session starts (Ray's daemons
included) lives in that host's PID namespace, so the `ray stop` that deploy/onprem.yaml and `ray
down` run on a node stops only that node's Ray, never other Rays on this machine; and /root and /tmp
are bind mounts of the host's own directories, so `~/tvmpipe`, `~/.ray/auth_token`,
`/tmp/ray/session_*` and the local provider's state files are per machine, as on real hosts. The
checkout and its venv are shared (like an NFS mount): each host's ~/tvmpipe-venv links to the venv.

The client (where `ray up` runs, the user's laptop) is one more host with its own /root and /tmp.
Keys: one client key (ed25519, made here) authorised on every server; one host key per server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from netbed import Host

SSHD = "/usr/sbin/sshd"
VENV = Path(sys.executable).parent.parent
_REAL = Path(os.path.realpath(sys.executable))
REPO = Path(__file__).resolve().parents[2]


def _tops(under: str) -> list[str]:
    """Top-level entries of `under` that hold what every machine must see where this one does: the
    checkout (a fresh clone may well sit in /tmp), its venv, and the venv's interpreter (e.g. pyenv
    under /root). Each machine's private /root and /tmp get them mounted back, like an NFS share."""
    tops: list[str] = []
    for path in (REPO, Path(os.path.realpath(VENV)), _REAL):
        if path.is_relative_to(under) and path != Path(under) and path.relative_to(under).parts[0] not in tops:
            tops.append(path.relative_to(under).parts[0])
    return tops


SHARED_HOME, SHARED_TMP = _tops("/root"), _tops("/tmp")


def missing() -> str | None:
    """What this machine lacks for the SSH bed (the Makefile's multihost-deps installs it), or None."""
    need = {SSHD: "openssh-server", shutil.which("ssh") or "ssh": "openssh-client",
            shutil.which("rsync") or "rsync": "rsync", shutil.which("ssh-keygen") or "ssh-keygen": "openssh-client"}
    lacking = sorted({pkg for path, pkg in need.items() if not os.path.exists(path)})
    return f"not installed: {', '.join(lacking)} (run `make multihost-deps` as root)" if lacking else None


@dataclass
class Machine:
    host: Host
    root: Path  # holds home/ (mounted on /root) and tmp/ (mounted on /tmp)

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    def prepare(self, authorized: str | None) -> None:
        (self.home / ".ssh").mkdir(parents=True, mode=0o700)
        self.tmp.mkdir(mode=0o1777)
        os.chmod(self.tmp, 0o1777)
        (self.home / ".bashrc").write_text("")
        (self.home / "tvmpipe-venv").symlink_to(VENV)
        if authorized is not None:
            (self.home / ".ssh" / "authorized_keys").write_text(authorized)
            os.chmod(self.home / ".ssh" / "authorized_keys", 0o600)

    def wrap(self, *argv: str) -> list[str]:
        """argv run on this machine: its network, its own PIDs, /root and /tmp. The checkout, its venv
        and the interpreter (see `_tops`) are mounted into the private /root and /tmp again."""
        keep = "".join(f'mkdir -p "$0/{mine}/{d}" && mount --bind "/{real}/{d}" "$0/{mine}/{d}" && '
                       for mine, real, tops in (("home", "root", SHARED_HOME), ("tmp", "tmp", SHARED_TMP)) for d in tops)
        script = keep + 'mount --rbind "$0/home" /root && mount --rbind "$0/tmp" /tmp && exec "$@"'
        return self.host.command("unshare", "--pid", "--fork", "--mount-proc", "--mount", "--propagation", "private",
                                 "sh", "-c", script, str(self.root), *argv)

    def start_sshd(self) -> subprocess.Popen:
        conf = self.tmp / "sshd"
        conf.mkdir()
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(conf / "host_key")], check=True)
        # Paths as the server sees them: /tmp is this machine's tmp/.
        (conf / "sshd_config").write_text("\n".join([
            f"ListenAddress {self.host.address}", "Port 22", "HostKey /tmp/sshd/host_key",
            "PidFile /tmp/sshd/sshd.pid", "AuthorizedKeysFile /root/.ssh/authorized_keys",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", "AllowTcpForwarding yes", "PrintMotd no", "LogLevel ERROR",
            "Subsystem sftp internal-sftp", ""]))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory (the package's own)
        proc = subprocess.Popen(self.wrap(SSHD, "-D", "-e", "-f", "/tmp/sshd/sshd_config"),
                                stdout=subprocess.DEVNULL, stderr=open(self.root / "sshd.log", "w"))
        deadline = time.time() + 20
        while time.time() < deadline:
            if any(c[3] == f"{self.host.address}:22" for c in self.host.sockets("-tl")):
                return proc
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"sshd on {self.host.name} did not start:\n{(self.root / 'sshd.log').read_text()[-2000:]}")


def client_key(client: Machine) -> tuple[Path, str]:
    """A key pair in the client's ~/.ssh (as the client sees it: /root/.ssh/id_ed25519) and its
    public half, for the servers' authorized_keys."""
    key = client.home / ".ssh" / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tvmpipe-test", "-f", str(key)], check=True)
    return Path("/root/.ssh/id_ed25519"), (key.with_suffix(".pub")).read_text()
