"""`--quantize int4|int8 [--group-size G]`: group quantization of a float checkpoint's weights.

MLC's q4f16_1 is the anchor: symmetric int4 with one float16 scale per group of G = 32 values of a
row, two values a byte (value k in byte k // 2); int8 the same with one int8 a value. The values
are GGUF's Q4_0 and Q8_0 with the group size free; the layouts are compiler/packed.py
`group_format`'s (int4's flat, so that dlight's GEMV rule schedules its matmuls), unpacked by the
same kind of ops and fused into the matmul kernels as a GGUF file's.

Each weight is quantized when the bundle's weights file is written, one tensor at a time, from
the checkpoint tensor read by byte range (streamed like any checkpoint compile):
`QuantizedTensor.numpy()` computes one field. Every linear layer and the input embedding (a
gather of its packed rows, then unpacked) are quantized; a tied head reads the embedding's
fields. GPT-2's Conv1D layers (weight [in, out], `x @ W + b`) become Linear layers of the same
function (ggufmodel.conv1d_as_linear, as for a GGUF file) whose weight [out, in] is the
checkpoint's read transposed, quantized in groups along its input features as any linear's; its
position table stays float. The model computes in the
checkpoint's dtype (or --dtype's): a bf16/fp16 one unpacks in float32 and rounds the weight once
to its dtype (q4f16: the float16 scale, float16 compute).

The values, for a group x of G floats (float32), as gguf.quants computes Q4_0 and Q8_0:
    int4: d = (the value of largest magnitude) / -8,  q = clip(trunc(x / d + 8.5), 0, 15)
    int8: d = max|x| / 127,  q = round(x / d)
q from the float32 d; d then stored as float16, and the weight computed with is the stored d
times (q - 8), or q. `fake_quantize` gives that weight (for the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tvmpipe.compiler.packed import PackedFormat, group_format

SCHEMES = ("int4", "int8")
DEFAULT_GROUP = 32


def quantize_blocks(w: np.ndarray, scheme: str, group: int) -> dict[str, np.ndarray]:
    """The fields {d, qs} of a float matrix [rows, cols] in `scheme` with groups of `group`."""
    from gguf import quants

    rows, cols = w.shape
    x = np.ascontiguousarray(w, np.float32).reshape(rows * cols // group, group)
    if scheme == "int4":
        imax = np.abs(x).argmax(axis=-1, keepdims=True)
        d = np.take_along_axis(x, imax, axis=-1) / -8
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, 0, 1 / d)
        q = np.trunc(x * inv + np.float32(8.5), dtype=np.float32).astype(np.uint8).clip(0, 15).reshape(rows, cols)
        qs = q[:, 0::2] | (q[:, 1::2] << np.uint8(4))  # group_format: value k in byte k // 2, even k low
    else:  # llama.cpp's Q8_0 with the group free (tests/compiler/test_quantize.py: the same values at 32)
        d = np.abs(x).max(axis=-1, keepdims=True) / 127
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, 0, 1 / d)
        qs = quants.np_roundf(x * inv).astype(np.int8)
    nb = cols // group
    if scheme == "int4":  # flat: [rows, groups] scales, [rows, cols / 2] codes
        return {"d": d.astype(np.float16).reshape(rows, nb), "qs": np.ascontiguousarray(qs)}
    return {"d": d.astype(np.float16).reshape(rows, nb, 1), "qs": qs.reshape(rows, nb, -1)}


def fake_quantize(w: np.ndarray, scheme: str, group: int) -> np.ndarray:
    """The float32 matrix a quantized bundle computes with (the fields dequantized as its ops do)."""
    import torch

    from tvmpipe.compiler.packed import dequantize

    f = quantize_blocks(w, scheme, group)
    fmt = group_format(scheme, group)
    return dequantize(fmt, {k: torch.from_numpy(v) for k, v in f.items()}).numpy().reshape(w.shape)


@dataclass(frozen=True)
class QuantizedTensor:
    """One field of a checkpoint matrix quantized when read (the CheckpointTensor interface)."""

    source: Any  # checkpoint.CheckpointTensor
    fmt: PackedFormat
    field_name: str
    scheme: str
    group: int

    @property
    def shape(self) -> tuple[int, ...]:
        r, c = self.source.shape
        return self.fmt.field_shape(r, c, next(f for f in self.fmt.fields if f.name == self.field_name))

    @property
    def dtype(self) -> str:
        return next(f for f in self.fmt.fields if f.name == self.field_name).dtype

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)

    def numpy(self) -> np.ndarray:
        w = self.source.numpy()
        if str(w.dtype) != "float32":
            w = w.astype(np.float32)
        return np.ascontiguousarray(quantize_blocks(w, self.scheme, self.group)[self.field_name])


@dataclass(frozen=True)
class TransposedTensor:
    """A checkpoint matrix read transposed: a Conv1D's weight [in, out] as the weight [out, in] of
    the Linear that computes the same function (the CheckpointTensor interface)."""

    source: Any  # checkpoint.CheckpointTensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.source.shape))

    @property
    def dtype(self) -> str:
        return self.source.dtype

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        return self.shape

    @property
    def nbytes(self) -> int:
        return self.source.nbytes

    def numpy(self) -> np.ndarray:
        return np.ascontiguousarray(self.source.numpy().T)


def check(scheme: str, group: int) -> None:
    from tvmpipe.compiler.errors import SourceError

    if scheme not in SCHEMES:
        raise SourceError(f"--quantize must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if group < 2 or group % 2 or group > 4096:
        raise SourceError(f"--group-size must be an even number from 2 to 4096, got {group}")


def quantize_linears(built: Any, scheme: str, group: int) -> list[str]:
    """Replace every nn.Linear of `built.model` (a hfmodel.CheckpointModel) by a PackedLinear of
    quantized fields, and the input embedding by a PackedEmbedding (the token's rows of the fields
    gathered, then unpacked; MLC quantizes its embedding too); a head tied to the embedding reads
    the embedding's fields (stored once); GPT-2's Conv1D layers first become the Linear layers of
    the same function (their weights read transposed). Returns the matrices quantized (a tied pair
    once)."""
    import torch

    from tvmpipe.compiler.errors import SourceError
    from tvmpipe.compiler.ggufmodel import conv1d_as_linear
    from tvmpipe.compiler.packed import packed_modules

    linear_cls, embedding_cls = packed_modules()
    fmt = group_format(scheme, group)
    model = built.model
    for conv, linear in conv1d_as_linear(model, torch):
        built.sources[id(linear.weight)] = TransposedTensor(built.sources[id(conv.weight)])
        if conv.bias is not None:
            linear.bias = conv.bias  # the checkpoint's bias, as it is
    emb_module = model.get_input_embeddings()
    emb = emb_module.weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb

    def fields_of(name: str, weight: Any) -> dict[str, Any]:
        rows, cols = weight.shape
        if cols % group:
            raise SourceError(f"--group-size {group} does not divide the {cols} columns of '{name}'")
        src = built.sources[id(weight)]
        out = {}
        for f in fmt.fields:
            t = QuantizedTensor(src, fmt, f.name, scheme, group)
            p = torch.nn.Parameter(torch.empty(t.shape, dtype=getattr(torch, f.dtype)), requires_grad=False)
            built.sources[id(p)] = t
            out[f.name] = p
        return out

    def replace(name: str, new: Any) -> None:
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, new)

    done = []
    modules = dict(model.named_modules())
    for name, module in list(modules.items()):
        if not isinstance(module, torch.nn.Linear) or module.weight is emb:
            continue
        rows, cols = module.weight.shape
        replace(name, linear_cls(fmt, rows, cols, fields_of(name, module.weight), module.bias,
                                 dtype=module.weight.dtype))
        done.append(name)
    if isinstance(emb_module, torch.nn.Embedding) and type(emb_module) is torch.nn.Embedding:
        emb_name = next(n for n, m in modules.items() if m is emb_module)
        rows, cols = emb.shape
        fields = fields_of(emb_name, emb)
        replace(emb_name, embedding_cls(fmt, rows, cols, fields, dtype=emb.dtype))
        done.append(emb_name)
        if tied:  # the head reads the same fields: one copy of the matrix in the bundle
            head_name = next(n for n, m in modules.items() if m is head)
            replace(head_name, linear_cls(fmt, rows, cols, fields, head.bias, dtype=emb.dtype))
    return done
