"""A slowed stage, for tests whose point needs work that outlasts a bound on any machine (a drain
timeout, a cancel mid-stream): with this directory on PYTHONPATH and TVMPIPE_TEST_STAGE_DELAY_S set,
every Stage.run in the process (a stage worker's) first sleeps that many seconds. Tests set both in
the environment of the process they start; nothing of tvmpipe reads the variable."""

import importlib.abc
import os
import sys
import time

DELAY = float(os.environ.get("TVMPIPE_TEST_STAGE_DELAY_S") or 0)
TARGET = "tvmpipe.executor.stage"


class _SlowStage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            run = module.Stage.run

            def slowed(self, *args, **kwargs):
                time.sleep(DELAY)
                return run(self, *args, **kwargs)

            module.Stage.run = slowed

        spec.loader.exec_module = exec_module
        return spec


if DELAY > 0:
    sys.meta_path.insert(0, _SlowStage())
