"""tvmpipe.cluster.wire: the data plane, how tensors cross an edge of the pipeline.

Modules:
  frames     the frame codec: an 8-byte prefix, a msgpack header describing every tensor, the raw
             tensor bytes; limits checked before anything is allocated (docs/frames.md)
  stream     reading and writing frames on a socket (buffers reused, payloads received in place)
  handshake  the authenticated hello (HMAC of the run's secret) and the Gate every listener admits
             connections through
  tcp        one TCP stream per edge: Listener (a thread per producer), PolledListener (the driver's
             selector), Link (the sending end); shared-memory and CUDA IPC frames ride it as notes
  shm        shared-memory rings between two processes of one node
  cudaipc    CUDA IPC device slots between two stages on one GPU node

The codec imports no transport; nothing here knows stages, plans or generation.
"""
