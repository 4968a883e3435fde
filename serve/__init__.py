"""tvmpipe.serve: `tvmpipe serve`, an OpenAI-compatible HTTP server over the generation layer."""
