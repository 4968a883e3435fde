"""The cluster launcher YAMLs pass Ray's own offline checks, so `ray up` fails on the network, not on them.

`prepare_config` is what `ray up` runs first (merges the provider's defaults, and for the local
provider builds its single node type); `validate_config` checks the result against Ray's schema.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private import util as ray_util

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
YAMLS = sorted(DEPLOY.glob("*.yaml"))


def _prepared(path: Path) -> dict:
    config = yaml.safe_load(path.read_text())
    prepared = ray_util.prepare_config(copy.deepcopy(config))
    ray_util.validate_config(prepared)
    return prepared


def test_both_cluster_kinds_are_shipped():
    kinds = {yaml.safe_load(p.read_text())["provider"]["type"] for p in YAMLS}
    assert {"local", "aws"} <= kinds


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_yaml_passes_ray_validation(path: Path):
    prepared = _prepared(path)
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_workers_get_the_cuda_extra_and_the_head_no_gpu_stages(path: Path):
    prepared = _prepared(path)
    worker_setup = " ".join(prepared["worker_setup_commands"])
    assert "tvmpipe[cuda]" in worker_setup
    assert "[cuda]" not in " ".join(prepared["head_setup_commands"])
    head_start = " ".join(prepared["head_start_ray_commands"])
    assert "--num-gpus=0" in head_start
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "RAY_AUTH_MODE=token" in " ".join(prepared["setup_commands"])
    assert "~/.ray/auth_token" in prepared["cluster_synced_files"]


def test_local_provider_lists_head_and_gpu_worker_hosts():
    config = yaml.safe_load((DEPLOY / "onprem.yaml").read_text())
    assert "available_node_types" not in config  # the local provider refuses it
    assert config["provider"]["head_ip"] and config["provider"]["worker_ips"]
    prepared = _prepared(DEPLOY / "onprem.yaml")
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["min_workers"] == len(config["provider"]["worker_ips"])


def test_aws_has_an_autoscaled_gpu_worker_type():
    prepared = _prepared(DEPLOY / "aws-gpu.yaml")
    workers = {k: v for k, v in prepared["available_node_types"].items() if k != prepared["head_node_type"]}
    assert workers, "no worker node type"
    gpu_types = [v for v in workers.values() if v["node_config"]["InstanceType"].startswith(("g", "p"))]
    assert gpu_types and all(v["max_workers"] >= v["min_workers"] >= 1 for v in gpu_types)
    assert prepared["docker"]["image"].endswith("-gpu")


def test_onprem_head_runs_autoscaler_v1_despite_ray_up():
    """`ray up` (Ray >= 2.50) prepends `export RAY_enable_autoscaler_v2=1; ...` to the head's start
    commands. Autoscaler v2 with the local provider launches only one of the worker hosts (it never
    records the head in the head's state file), so deploy/onprem.yaml must start the head with v1:
    run the commands as ray up composes them, with `ray` a shell function that reports what it sees."""
    prepared = _prepared(DEPLOY / "onprem.yaml")
    composed = ray_util.with_envs(prepared["head_start_ray_commands"],
                                  {"RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": "h",
                                   "RAY_NODE_TYPE_NAME": "t"})
    script = 'ray() { [ "$1" = start ] && echo "v2=$RAY_enable_autoscaler_v2"; return 0; }; ulimit() { :; }\n'
    seen = subprocess.run(["bash", "-c", script + "\n".join(composed)], capture_output=True, text=True, timeout=30)
    assert seen.stdout.split() == ["v2=0"], seen.stdout + seen.stderr
