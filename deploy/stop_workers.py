"""Stop Ray on every worker host of an on-premises cluster (`local` provider) before `ray down`.

    ray submit deploy/onprem.yaml deploy/stop_workers.py
    ray down deploy/onprem.yaml --yes

Why it exists: `ray down` runs `ray stop` on the head only. The local provider cannot stop a host,
it only marks it terminated in its state file, so the workers' Ray keeps running: each raylet ends
itself once the head's GCS has been unreachable for 60 s (Ray's gcs_rpc_server_reconnect_timeout_s),
and its dashboard and runtime-env agents about 60 s after that (they first try to report the
raylet's death to the GCS that is gone). Measured on the test bed: ~2 min of Ray processes, their
ports open, on every worker after `ray down` returned.

It runs on the head, which holds what `ray up` gave it to reach the workers: the cluster config
(~/ray_bootstrap_config.yaml: worker_ips, ssh_user) and the SSH key (~/ray_bootstrap_key.pem). Each
worker gets `ray stop` the way Ray's own SSH runner runs commands there (a login shell that sources
~/.bashrc, where deploy/onprem.yaml puts the venv on PATH), with Ray's own host-key policy.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"
SSH_TIMEOUT_S = 120


@dataclass(frozen=True)
class Worker:
    address: str
    user: str
    key: Path

    def ssh(self, command: str) -> list[str]:
        """argv that runs `command` on this worker as Ray's SSH runner would."""
        return ["ssh", "-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30",
                f"{self.user}@{self.address}", f"bash --login -c -i 'source ~/.bashrc; {command}'"]


class ConfigError(Exception):
    """The head's bootstrap config is missing or lacks a field."""


def workers_from(path: Path) -> list[Worker]:
    """The worker hosts listed in a `ray up` bootstrap config of the local provider."""
    try:
        cfg = yaml.safe_load(path.read_text())
        provider, auth = cfg["provider"], cfg["auth"]
        if provider["type"] != "local":
            raise ConfigError(f"{path}: provider.type is {provider['type']!r}; only the local provider "
                              "leaves worker hosts running after `ray down`")
        return [Worker(ip, auth["ssh_user"], Path(auth["ssh_private_key"]).expanduser())
                for ip in provider["worker_ips"]]
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror} (run this on the head of a cluster started by `ray up`)") from None
    except (KeyError, TypeError, yaml.YAMLError) as exc:
        why = " ".join(str(exc).split())  # YAML errors span lines (with a caret drawing): keep one
        raise ConfigError(f"{path}: not a cluster config with provider.worker_ips and auth ({why})") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0] if argv else BOOTSTRAP_CONFIG).expanduser()
    try:
        workers = workers_from(path)
    except ConfigError as exc:
        print(f"stop_workers: error: {exc}", file=sys.stderr)
        return 2
    failed = 0
    for w in workers:
        try:
            done = subprocess.run(w.ssh("ray stop"), capture_output=True, text=True, timeout=SSH_TIMEOUT_S)
            ok, why = done.returncode == 0, (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        except subprocess.TimeoutExpired:
            ok, why = False, f"no answer within {SSH_TIMEOUT_S} s"
        print(f"{w.address}: {'ray stopped' if ok else 'FAILED: ' + why}")
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
