"""A thread-block tile for matmuls of a few rows: a decode step's linear layers at batch 2-16.

dlight's Matmul rule tiles every matmul 64 x 64 (8 x 16 threads, 4 x 4 outputs a thread) and pads
the rows up to the tile. A decode step at batch 8 multiplies 8 rows by each weight matrix: the rule
pads them to 64 and runs one thread block per 64 columns (9 blocks for a 576-column output on a
132-SM GPU), so its matmuls took 9x the batch-1 GEMVs for 8x the rows. On an H200 (docs/
gpu-validation.md, bench/decode_schedules.py's `rows8`) a tile of 8 rows x 32 columns (2 x 32
threads, 4 rows a thread) took 24 % off those matmuls (SmolLM-135M's and TinyLlama-1.1B's
configurations, tokens identical to batch 1 and to the reference backend); 8 x 128 was slower.

`SmallRows` is dlight's own Matmul rule with that configuration, applied only to a function whose
one reduction reads a 2-D float buffer the function takes (a weight matrix; not packed int4/GGUF
fields, whose unpack+matmul kernels were not measured with it) and writes 2-16 rows with static
shapes; everything else goes on to the default rules. tvmpipe puts it first for decode steps
only (compiler/export.py): their kernels are what the GPU measurement covered.
"""

from __future__ import annotations

from typing import Any

ROWS = (2, 16)  # the output rows the tile is for (batch x chunk of a decode step)


def weight_rows(func: Any) -> int | None:
    """The output rows of a function whose one reduction reads a 2-D float buffer the function takes
    (a weight matrix), when every output dimension is static; else None."""
    import math

    from tvm import s_tir, tirx
    from tvm.s_tir.dlight.analysis import get_root_block
    from tvm.s_tir.dlight.gpu.matmul import get_reduction_blocks

    try:
        sch = s_tir.Schedule(func)
        root = get_root_block(sch)
        reductions = get_reduction_blocks(sch, sch.get_child_blocks(root))
    except Exception:  # noqa: BLE001 - a function this analysis does not understand is not one of ours
        return None
    if not reductions or len(reductions) != 1:
        return None
    block = sch.get(reductions[0])
    local = set(sch.get(root).alloc_buffers)
    if not any(r.source not in local and len(r.source.shape) == 2 and "float" in str(r.source.dtype)
               for r in block.reads):
        return None  # no float weight read: packed (int4/GGUF) matmuls keep their own schedules
    shape = block.writes[0].source.shape
    if not all(isinstance(s, tirx.IntImm) for s in shape):
        return None
    return math.prod(int(s) for s in shape[:-1])


def small_rows_rule(column_threads: int = 32, columns_each: int = 1) -> Any:
    """dlight's Matmul rule with the 8-row tile (8 rows x `column_threads` x `columns_each`
    columns a block; the default is the measured one, bench/decode_schedules.py tries others), for
    the functions `weight_rows` puts in ROWS."""
    import tvm.s_tir.dlight as dl
    from tvm import tirx

    class SmallRows(dl.gpu.Matmul):
        config = dl.gpu.Matmul.Config(block_size_x=2, block_size_y=column_threads, vthread_x=1, vthread_y=1,
                                      micro_size_x=4, micro_size_y=columns_each, micro_size_k=16, vector_size=2,
                                      unroll=256, use_shared=True, storage_align=True, inner_x=False)

        def get_configs(self, target: Any) -> Any:  # noqa: ARG002 - one tile, whatever the GPU
            return self.config

        def apply(self, func: Any, target: Any, tunable: bool) -> Any:
            rows = weight_rows(func) if isinstance(func, tirx.PrimFunc) else None
            if rows is None or not ROWS[0] <= rows <= ROWS[1]:
                return None
            return super().apply(func, target, tunable)

    return SmallRows()
