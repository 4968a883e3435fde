"""tvmpipe.core: what every layer shares and none owns. It imports nothing of tvmpipe.

- errors.py: TvmpipeError, the base of every error raised on purpose (printed without a traceback);
- units.py: byte counts for people;
- files.py: output files written atomically (temporary name, then rename);
- table.py: the one text-table renderer (inspect, profile, run).
"""
