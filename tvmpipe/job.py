"""`python -m tvmpipe.job`: the cluster job entry point. Its code lives in deploy/job.py (tvmpipe.deploy.job),
which `ray submit CLUSTER.yaml deploy/job.py` also runs directly as a script."""

import sys

from tvmpipe.deploy.job import main

if __name__ == "__main__":
    sys.exit(main())
