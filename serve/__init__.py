"""tvmpipe.serve: `tvmpipe serve`, an OpenAI-compatible HTTP server over the generation layer.

Modules, from the socket in:
  server    uvicorn in this process, the engine in a process of its own; signals, drain, exit
  app       the HTTP routes (FastAPI) and the Gate around them (API key, body bound, counts)
  protocol  the OpenAI protocol: request bodies read into an Ask, errors, response and chunk objects
  service   the served model: how an Ask becomes generation requests, and their answers
  sequence  one request's outputs read on the event loop (ServedSequence), merged when it falls behind
  metrics   GET /metrics in Prometheus' text format
"""
