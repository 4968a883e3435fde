"""tvmpipe.deploy: running tvmpipe on a Ray cluster unattended.

- job.py: `python -m tvmpipe.job`, one pipeline run as a cluster job (also a plain script for
  `ray submit CLUSTER.yaml deploy/job.py`);
- rundir.py: the job's run directory, written one atomic file at a time;
- onprem.yaml, aws-gpu.yaml: Ray cluster launcher configs (see docs/cluster-jobs.md).
"""
