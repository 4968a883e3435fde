"""Packed (quantized) weights: their block layouts, and the ops that dequantize them in the graph.

A quantized weight is never dequantized by the compiler. Its blocks are split into their fields
(each field one array of the bundle, the file's bytes in block order: nothing is re-quantized, the
bundle holds exactly the file's bytes), and the model reads them through `PackedLinear` /
`PackedEmbedding`, whose forward is the dequantization written as integer unpack ops (shifts,
masks, casts, scales) feeding the matmul. torch.export traces those ops, TVM imports them as
Relax ops (`right_shift`, `bitwise_and`, `astype`, `multiply`, ...), the reference backend runs
them in NumPy, and the fuse step (compiler/dequantfuse.py) puts each weight's unpack ops into the
kernel of the matmul that reads it, so no kernel writes a float weight to memory.

The dequantization follows gguf's NumPy dequantizers (gguf/quants.py) op for op, in the same
float32 order, so a bundle computes with the float values transformers' GGUF loader computes.

Layouts (`FORMATS`): GGUF's, per block of `block` values of one row, fields at byte offsets:

    Q8_0  32 values, 34 B: d f16 | qs 32 x int8                         w = qs * d
    Q4_0  32 values, 18 B: d f16 | qs 16 B (value i low nibble of byte i, value 16 + i high)
                                                                        w = d * (q - 8)
    Q4_1  32 values, 20 B: d f16 | m f16 | qs 16 B                      w = d * q + m
    Q5_0  32 values, 22 B: d f16 | qh 4 B (bit i: value i's 5th bit) | qs 16 B
                                                                        w = d * (q - 16)
    Q5_1  32 values, 24 B: d f16 | m f16 | qh 4 B | qs 16 B             w = d * q + m
    Q4_K  256 values, 144 B: d f16 | dmin f16 | scales 12 B (8 x 6-bit scale, 8 x 6-bit min) |
                             qs 128 B (4 groups of 32 bytes: sub-block 2j low nibbles, 2j+1 high)
                                                                        w = d*sc * q - dmin*min
    Q5_K  256 values, 176 B: d | dmin | scales 12 B | qh 32 B (bit j of byte i: sub-block j) | qs 128 B
    Q6_K  256 values, 210 B: ql 128 B | qh 64 B | scales 16 x int8 | d f16   w = d*sc * (q - 32)

F16 and BF16 matrices are kept in their dtype too (field `w`) and widened in the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Field:
    """One field of a block: `nbytes` at `offset`, read as `dtype` (count = nbytes / itemsize)."""

    name: str
    offset: int
    nbytes: int
    dtype: str

    @property
    def count(self) -> int:
        return self.nbytes // (1 if self.dtype in ("uint8", "int8") else 2)


@dataclass(frozen=True)
class PackedFormat:
    name: str  # GGUF's type name (Q4_K), or int4/int8 for --quantize's groups
    block: int  # values per block
    block_bytes: int
    fields: tuple[Field, ...]

    flat: bool = False  # fields stored [rows, blocks * count]: one index per value (int4, below)

    def field_shape(self, rows: int, cols: int, field: Field) -> tuple[int, ...]:
        """A field's array shape for a [rows, cols] matrix: [rows, blocks, count] ([rows, cols] for F16/BF16,
        [rows, blocks * count] for a flat format)."""
        if self.block == 1:
            return (rows, cols)
        if self.flat:
            return (rows, cols // self.block * field.count)
        return (rows, cols // self.block, field.count)


def _f(name: str, offset: int, nbytes: int, dtype: str = "uint8") -> Field:
    return Field(name, offset, nbytes, dtype)


FORMATS: dict[str, PackedFormat] = {f.name: f for f in (
    PackedFormat("Q8_0", 32, 34, (_f("d", 0, 2, "float16"), _f("qs", 2, 32, "int8"))),
    PackedFormat("Q4_0", 32, 18, (_f("d", 0, 2, "float16"), _f("qs", 2, 16))),
    PackedFormat("Q4_1", 32, 20, (_f("d", 0, 2, "float16"), _f("m", 2, 2, "float16"), _f("qs", 4, 16))),
    PackedFormat("Q5_0", 32, 22, (_f("d", 0, 2, "float16"), _f("qh", 2, 4), _f("qs", 6, 16))),
    PackedFormat("Q5_1", 32, 24, (_f("d", 0, 2, "float16"), _f("m", 2, 2, "float16"), _f("qh", 4, 4),
                                  _f("qs", 8, 16))),
    PackedFormat("Q4_K", 256, 144, (_f("d", 0, 2, "float16"), _f("dmin", 2, 2, "float16"), _f("scales", 4, 12),
                                    _f("qs", 16, 128))),
    PackedFormat("Q5_K", 256, 176, (_f("d", 0, 2, "float16"), _f("dmin", 2, 2, "float16"), _f("scales", 4, 12),
                                    _f("qh", 16, 32), _f("qs", 48, 128))),
    PackedFormat("Q6_K", 256, 210, (_f("ql", 0, 128), _f("qh", 128, 64), _f("scales", 192, 16, "int8"),
                                    _f("d", 208, 2, "float16"))),
    PackedFormat("F16", 1, 2, (_f("w", 0, 2, "float16"),)),
    PackedFormat("BF16", 1, 2, (_f("w", 0, 2, "bfloat16"),)),
)}


def group_format(scheme: str, group: int) -> PackedFormat:
    """--quantize's layouts: a float16 scale d per `group` values of a row, and the codes.
    int8: Q8_0's with the group free (qs [rows, groups, group] int8). int4: MLC's q4f16_1, flat:
    qs [rows, cols / 2], value k of a row in byte k // 2, the low nibble for even k; d
    [rows, cols / group]. The flat layout reads the codes at one index per value (k // 2), which
    dlight's GEMV rule can schedule (Q4_0's order, value i and value 16 + i in one byte, reads
    them at two: k // 32 and k % 16)."""
    if scheme == "int4":
        return PackedFormat("int4", group, 2 + group // 2, (_f("d", 0, 2, "float16"), _f("qs", 2, group // 2)),
                            flat=True)
    return PackedFormat("int8", group, 2 + group, (_f("d", 0, 2, "float16"), _f("qs", 2, group, "int8")))


def manifest(tensors: dict[str, Any]) -> dict[str, Any]:
    """bundle.json `source.packed`: each packed matrix (named after its fields' common prefix),
    its format, its [rows, cols] and which graph param holds each field; `tvmpipe inspect` reads
    it. `tensors` maps graph param names to their field tensors (`fmt`, `field_name`,
    `matrix_shape`)."""
    out: dict[str, Any] = {}
    for name, t in sorted(tensors.items()):
        matrix = name[: -len(t.field_name) - 1] if name.endswith("_" + t.field_name) else name
        entry = out.setdefault(matrix, {"format": t.fmt.name, "block": t.fmt.block,
                                        "shape": list(t.matrix_shape), "fields": {}})
        entry["fields"][t.field_name] = name
    return out


def _shifts(*values: int) -> Any:
    """A small uint8 constant of shift amounts, shaped [n, 1] to broadcast over a field's last axis."""
    import torch

    return torch.tensor(values, dtype=torch.uint8).reshape(len(values), 1)


def _nibbles(qs: Any, lead: tuple[int, ...]) -> Any:
    """[..., 2, n] low then high nibbles of bytes [..., n] (as gguf: `qs >> [0, 4] & 0x0F`)."""
    return (qs.reshape(*lead, 1, qs.shape[-1]) >> _shifts(0, 4)) & 15


def _scale_min_k4(scales: Any) -> tuple[Any, Any]:
    """Q4_K/Q5_K: the 8 six-bit scales and 8 six-bit mins of each block's 12 scale bytes (gguf's
    Q4_K.get_scale_min). Bytes 0-3 (d) hold scales 0-3 and the top bits of scales 4-7, bytes 4-7
    (m) mins 0-3 and the top bits of mins 4-7, bytes 8-11 (md) the low nibbles of scales 4-7 and
    mins 4-7. Written without a concat: entry h*4 + i is `((x[i] >> a_h) & b_h) | ((md[i] >> c_h) &
    e_h)` with per-half constants, so each value reads one byte of each of two fields at an index
    affine in its own: the schedule (dlight's GEMV/Reduction) can inline it into the matmul."""
    import torch

    s = scales.reshape(*scales.shape[:-1], 1, 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]  # [..., 1, 4], broadcast over the halves h

    def const(*v: int) -> Any:
        return torch.tensor(v, dtype=torch.uint8).reshape(2, 1)

    lo = (md & const(0, 15))  # h = 0: nothing from md; h = 1: its low nibble
    sc = ((d >> const(0, 2)) & const(63, 48)) | lo
    mn = ((m >> const(0, 2)) & const(63, 48)) | ((md >> const(0, 4)) & const(0, 15))
    return sc.reshape(*scales.shape[:-1], 8), mn.reshape(*scales.shape[:-1], 8)


def dequantize(fmt: PackedFormat, f: dict[str, Any]) -> Any:
    """float32 [R, cols] of a packed matrix's fields (torch tensors [R, blocks, count]): the ops a
    bundle runs, in gguf's order."""
    import torch

    f32 = torch.float32
    if fmt.block == 1:
        return f["w"].to(f32)
    if fmt.flat:  # int4: codes [R, cols/2], scales [R, groups]; every value read at one index
        qs, d = f["qs"], f["d"]
        r, nb = d.shape
        cols = nb * fmt.block
        # value k: byte k // 2, low nibble for even k. Both nibbles of a value's byte are taken from
        # the same read (a stack, not a shift by a constant tensor), so the kernel reads the codes
        # and the scales and nothing else per value: dlight's GEMV rule takes it (a shift-amount
        # buffer is a second "vector" input, which that rule refuses).
        q = torch.stack([qs & 15, qs >> 4], dim=-1).reshape(r, cols)
        scale = d.to(f32).reshape(r, nb, 1).expand(r, nb, fmt.block).reshape(r, cols)  # d[k // group]
        return scale * (q.to(f32) - 8.0)
    first = f[fmt.fields[0].name]
    r, nb = first.shape[0], first.shape[1]
    name = fmt.name
    if name in ("Q8_0", "int8"):
        w = f["qs"].to(f32) * f["d"].to(f32)
    elif name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        q = _nibbles(f["qs"], (r, nb)).reshape(r, nb, 32)
        if name in ("Q5_0", "Q5_1"):
            bits = (f["qh"].reshape(r, nb, 4, 1) >> _shifts(*range(8)).reshape(8)) & 1  # [R, nb, 4 bytes, 8 bits]
            q = q | (bits.reshape(r, nb, 32) << 4)
        d = f["d"].to(f32)
        if name in ("Q4_1", "Q5_1"):
            w = d * q.to(f32) + f["m"].to(f32)
        else:
            w = d * (q.to(f32) - (8.0 if name == "Q4_0" else 16.0))
    elif name in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min_k4(f["scales"])
        d = (f["d"].to(f32) * sc.to(f32)).reshape(r, nb, 8, 1)
        dm = (f["dmin"].to(f32) * mn.to(f32)).reshape(r, nb, 8, 1)
        q = _nibbles(f["qs"].reshape(r, nb, 4, 32), (r, nb, 4)).reshape(r, nb, 8, 32)
        if name == "Q5_K":
            hb = (f["qh"].reshape(r, nb, 1, 32) >> _shifts(*range(8))) & 1  # [R, nb, 8, 32]
            q = q | (hb << 4)
        w = d * q.to(f32) - dm
    elif name == "Q6_K":
        d = (f["d"].to(f32) * f["scales"].to(f32)).reshape(r, nb, 16, 1)
        ql = _nibbles(f["ql"].reshape(r, nb, 2, 64), (r, nb, 2)).reshape(r, nb, 8, 32)
        qh = ((f["qh"].reshape(r, nb, 2, 1, 32) >> _shifts(0, 2, 4, 6)) & 3).reshape(r, nb, 8, 32)
        q = (ql | (qh << 4)).to(f32) - 32.0
        w = d * q.reshape(r, nb, 16, 16)
    else:  # formats are checked where the file is read; this is a programming error
        raise ValueError(f"no dequantization for {name}")
    return w.reshape(r, nb * fmt.block)


def packed_modules() -> tuple[type, type]:
    """(PackedLinear, PackedEmbedding): torch modules reading a packed matrix (defined here, in a
    function, so that importing this module needs no torch)."""
    global _MODULES
    if _MODULES is None:
        _MODULES = _define_modules()
    return _MODULES


_MODULES: tuple[type, type] | None = None


def _define_modules() -> tuple[type, type]:
    import torch

    class _Packed(torch.nn.Module):
        def __init__(self, fmt: PackedFormat, rows: int, cols: int, fields: dict[str, Any],
                     dtype: Any = torch.float32) -> None:
            super().__init__()
            self.fmt, self.rows, self.cols, self.dtype = fmt, rows, cols, dtype
            for name, p in fields.items():
                self.register_parameter(name, p)

        def fields(self) -> dict[str, Any]:
            return {f.name: getattr(self, f.name) for f in self.fmt.fields}

        @property
        def weight(self) -> Any:
            """What transformers reads a layer's dtype from (get_output_embeddings().weight.dtype):
            the dtype the matrix computes in."""
            return torch.empty(0, dtype=self.dtype)

        def unpacked(self, fields: dict[str, Any]) -> Any:
            """The float matrix: unpacked in float32 (gguf's order), then rounded once to the
            compute dtype where that is half precision (what a bf16 model holding the
            dequantized weight holds)."""
            w = dequantize(self.fmt, fields)
            return w if self.dtype == torch.float32 else w.to(self.dtype)

    class PackedLinear(_Packed):
        """nn.Linear over a packed weight [out, in]: dequantize (unpack ops), then F.linear."""

        def __init__(self, fmt: PackedFormat, rows: int, cols: int, fields: dict[str, Any], bias: Any = None,
                     dtype: Any = torch.float32) -> None:
            super().__init__(fmt, rows, cols, fields, dtype)
            self.bias = bias
            self.in_features, self.out_features = cols, rows

        def forward(self, x: Any) -> Any:
            return torch.nn.functional.linear(x, self.unpacked(self.fields()), self.bias)

    class PackedEmbedding(_Packed):
        """nn.Embedding over a packed table [vocab, dim]: the ids' rows of each field, then dequantized."""

        def __init__(self, fmt: PackedFormat, rows: int, cols: int, fields: dict[str, Any],
                     dtype: Any = torch.float32) -> None:
            super().__init__(fmt, rows, cols, fields, dtype)
            self.num_embeddings, self.embedding_dim = rows, cols

        def forward(self, ids: Any) -> Any:
            flat = ids.reshape(-1)
            rows = {k: torch.index_select(v, 0, flat) for k, v in self.fields().items()}
            return self.unpacked(rows).reshape(*ids.shape, self.cols)

    return PackedLinear, PackedEmbedding
