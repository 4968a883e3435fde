"""tvmpipe.cluster.control: the control plane, how stage workers are started, watched and stopped.

Modules:
  launchers    the Launcher interface, Timeouts and worker errors, and the process launcher (child
               processes on this machine, no Ray)
  ray_actors   the Ray launcher: stage actors in a placement group (StageActor wraps a StageWorker)
  placement    where stage actors go (spread, pack, GPUs per stage)
  shipping     a bundle's files and each node's weights slice, shipped through Ray's object store
  environment  the variables worker processes get (BLAS threads)
  local        a loopback-only Ray head for local mode
  reaper       cleans up after a driver that was killed (processes, shared memory, shipped copies)
  headwatch    notices the cluster's head going away
"""
