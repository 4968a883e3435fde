"""tvmpipe.core: what every layer shares and none owns. It imports nothing of tvmpipe.

- errors.py: TvmpipeError, the base of every error raised on purpose (printed without a traceback);
- units.py: byte counts for people;
- files.py: output files written atomically (temporary name, then rename), and JsonLines, an
  append-only results file whose every line is whole or absent;
- lazy.py: a package's exports imported on first use (cluster, generation);
- memory.py: fresh host memory for large buffers about to be filled whole (populated mappings);
- table.py: the one text-table renderer (inspect, profile, run).
"""
