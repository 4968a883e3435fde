"""tvmpipe.deploy: running tvmpipe on a Ray cluster unattended.

- job.py: `python -m tvmpipe.job`, one pipeline run as a cluster job (also a plain script for
  `ray submit CLUSTER.yaml deploy/job.py`);
- rundir.py: the job's run directory, written one atomic file at a time;
- stop_workers.py: stops Ray on every worker host of an on-premises cluster before `ray down`;
- onprem.yaml, aws-gpu.yaml: Ray cluster launcher configs (see docs/cluster-jobs.md).
"""
