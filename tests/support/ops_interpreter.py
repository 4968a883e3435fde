"""A minimal NumPy interpreter of ops.json programs, written from docs/ops.md only.

Test helper, not the product's reference backend: it exists to prove that the op programs the
compiler records compute what the fused CUDA/LLVM functions compute, and that docs/ops.md
describes the attrs correctly.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def _pad(x: np.ndarray, padding: list[int], value: float) -> np.ndarray:
    top, left, bottom, right = padding
    return np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=value)


def _windows(x: np.ndarray, attrs: dict, value: float) -> np.ndarray:
    """[N, C, OH, OW, KH, KW] windows of an NCHW tensor (strides, dilation, padding, ceil_mode)."""
    assert attrs.get("layout", attrs.get("data_layout", "NCHW")) == "NCHW"
    kh, kw = attrs["pool_size"]
    (sh, sw), (dh, dw) = attrs["strides"], attrs["dilation"]
    top, left, bottom, right = attrs["padding"]
    h, w = x.shape[2] + top + bottom, x.shape[3] + left + right
    ekh, ekw = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    rnd = math.ceil if attrs.get("ceil_mode") else math.floor
    oh, ow = rnd((h - ekh) / sh) + 1, rnd((w - ekw) / sw) + 1
    extra_h, extra_w = max(0, (oh - 1) * sh + ekh - h), max(0, (ow - 1) * sw + ekw - w)
    xp = _pad(x, [top, left, bottom + extra_h, right + extra_w], value)
    win = sliding_window_view(xp, (ekh, ekw), axis=(2, 3))[:, :, ::sh, ::sw, ::dh, ::dw]
    return win[:, :, :oh, :ow]


def conv2d(x: np.ndarray, w: np.ndarray, a: dict) -> np.ndarray:
    assert (a["data_layout"], a["kernel_layout"]) == ("NCHW", "OIHW")
    g = a["groups"]
    win = _windows(x.astype(np.float64), {**a, "pool_size": list(w.shape[2:])}, 0.0)  # N C OH OW KH KW
    n, c, oh, ow = win.shape[:4]
    o = w.shape[0]
    k = (c // g) * w.shape[2] * w.shape[3]
    # per group: [N*OH*OW, C/g*KH*KW] @ [C/g*KH*KW, O/g]
    win = win.reshape(n, g, c // g, oh, ow, *w.shape[2:]).transpose(1, 0, 3, 4, 2, 5, 6).reshape(g, n * oh * ow, k)
    wg = w.astype(np.float64).reshape(g, o // g, k).transpose(0, 2, 1)
    out = np.matmul(win, wg)  # g, N*OH*OW, O/g
    return out.reshape(g, n, oh, ow, o // g).transpose(1, 0, 4, 2, 3).reshape(n, o, oh, ow)


def run_op(op: str, a: dict, xs: list[np.ndarray]) -> list[np.ndarray]:
    x = xs[0] if xs else None
    if op == "add":
        return [xs[0] + xs[1]]
    if op == "subtract":
        return [xs[0] - xs[1]]
    if op == "multiply":
        return [xs[0] * xs[1]]
    if op == "divide":
        return [xs[0] / xs[1]]
    if op == "nn.relu":
        return [np.maximum(x, 0)]
    if op == "sigmoid":
        return [1 / (1 + np.exp(-x))]
    if op == "tanh":
        return [np.tanh(x)]
    if op == "nn.gelu":
        from math import erf

        return [0.5 * x * (1 + np.vectorize(erf)(x / math.sqrt(2)))]
    if op == "matmul":
        return [np.matmul(xs[0].astype(np.float64), xs[1].astype(np.float64))]
    if op == "nn.conv2d":
        return [conv2d(xs[0], xs[1], a)]
    if op == "nn.max_pool2d":
        return [_windows(x, a, -np.inf).max(axis=(4, 5))]
    if op == "nn.avg_pool2d":
        win = _windows(x, a, 0.0)
        if a["count_include_pad"]:
            return [win.mean(axis=(4, 5))]
        ones = _windows(np.ones_like(x), a, 0.0)
        return [win.sum(axis=(4, 5)) / ones.sum(axis=(4, 5))]
    if op == "mean":
        axis = None if a["axis"] is None else tuple(a["axis"])
        return [np.mean(x, axis=axis, keepdims=a["keepdims"])]
    if op in ("nn.softmax", "nn.log_softmax"):
        m = x.max(axis=a["axis"], keepdims=True)
        s = np.exp(x - m).sum(axis=a["axis"], keepdims=True)
        return [np.exp(x - m) / s if op == "nn.softmax" else x - m - np.log(s)]
    if op == "nn.layer_norm":
        axes = tuple(a["axes"])
        mean = x.mean(axis=axes, keepdims=True)
        var = x.var(axis=axes, keepdims=True)
        y = (x - mean) / np.sqrt(var + a["epsilon"])
        if a["scale"]:
            y = y * xs[1]
        if a["center"]:
            y = y + xs[2]
        return [y]
    if op == "reshape":
        return [x.reshape(a["shape"])]
    if op == "permute_dims":
        return [np.transpose(x, a["axes"])]
    if op == "broadcast_to":
        return [np.broadcast_to(x, a["shape"])]
    if op == "concat":
        return [np.concatenate(xs, axis=a["axis"])]
    if op == "split":
        return list(np.split(x, a["indices_or_sections"], axis=a["axis"]))
    raise NotImplementedError(op)


def run_program(prog: dict[str, Any], args: list[np.ndarray]) -> list[np.ndarray]:
    """Evaluate one ops.json function (in float64) on its input arrays."""
    outs: list[list[np.ndarray]] = []

    def value(ref: dict) -> np.ndarray:
        if "arg" in ref:
            return args[ref["arg"]].astype(np.float64)
        if "op" in ref:
            return outs[ref["op"]][ref.get("index", 0)]
        c = ref["const"]
        return np.array(c["data"], dtype=np.float64).reshape(c["shape"])

    for o in prog["ops"]:
        xs = [value(r) for r in o["inputs"]]
        assert [list(v.shape) for v in xs] == o["input_shapes"], o["op"]
        res = run_op(o["op"], o["attrs"], xs)
        assert [list(v.shape) for v in res] == o["output_shapes"], o["op"]
        outs.append(res)
    return [value(r) for r in prog["outputs"]]
