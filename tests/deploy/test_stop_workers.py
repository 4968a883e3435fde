"""deploy/stop_workers.py reads the head's bootstrap config; what it does over SSH is proven end to
end by tests/multihost/test_multihost_rayup.py. Here: bad configs give one line naming the file."""

from __future__ import annotations

from pathlib import Path

import yaml

from tvmpipe.deploy.stop_workers import Worker, main, workers_from


def _config(tmp_path: Path, **provider) -> Path:
    path = tmp_path / "ray_bootstrap_config.yaml"
    cfg = {"provider": {"type": "local", "head_ip": "192.0.2.10", "worker_ips": ["192.0.2.11", "192.0.2.12"],
                        **provider}, "auth": {"ssh_user": "tvmpipe", "ssh_private_key": "~/ray_bootstrap_key.pem"}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_workers_are_the_local_providers_worker_ips(tmp_path):
    workers = workers_from(_config(tmp_path))
    assert [w.address for w in workers] == ["192.0.2.11", "192.0.2.12"]
    assert workers[0].user == "tvmpipe" and workers[0].key == Path("~/ray_bootstrap_key.pem").expanduser()
    argv = workers[0].ssh("ray stop")
    assert argv[0] == "ssh" and "tvmpipe@192.0.2.11" in argv and argv[-1].endswith("ray stop'")


def test_bad_configs_fail_in_one_line_naming_the_file(tmp_path, capsys):
    cases = [tmp_path / "absent.yaml", _config(tmp_path, type="aws")]
    broken = tmp_path / "broken.yaml"
    broken.write_text("provider: [")
    cases.append(broken)
    for path in cases:
        assert main([str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(path) in err and "Traceback" not in err, err


def test_worker_is_a_plain_dataclass():
    assert Worker("10.0.0.1", "u", Path("/k")) == Worker("10.0.0.1", "u", Path("/k"))
