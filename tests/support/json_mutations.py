"""Hypothesis strategies that damage JSON documents structurally (a value replaced, removed or
duplicated anywhere in the tree) and textually (characters cut, inserted, replaced), for fuzzing
the readers: whatever comes out, they must answer with their own error type or a valid result."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

# Values real files hold, so a replacement is often *almost* right and gets deep into the checks.
_NEAR_MISSES = st.sampled_from([
    0, 1, 2, -1, 3, 7, 2**31, 10**12, 2**64, 0.5, float("nan"), True, None, "", "1", "-1", "two",
    "null", "tvm_op", "__nop", "__copy", "float32", "bool", "uint1", "bfloat16", "list_int", "list_str",
    "list_shape", "size_t", [], {}, [0, 0, 0], [0, 0], [1, 0], [99, 0, 0], [-1], [1, 4], [2**40, 2**40],
    {"arg": 0}, {"arg": 9}, {"workspace": 1}, {"scalar": 2**40, "dtype": "int32"}, {"op": 0}, {"seed": -1},
])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8) | _NEAR_MISSES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every position in the tree, as a tuple of keys / indices (the root is ())."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths(v, prefix + (i,))
    return out


@st.composite
def structural(draw: st.DrawFn, doc: Any, doc_paths: list[tuple], max_edits: int = 3) -> Any:
    """A deep copy of `doc` with 1..max_edits edits at random positions (of the original tree)."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, max_edits))):
        path = draw(st.sampled_from(doc_paths))
        node, parent = doc, None  # parent: the container of path[-1]
        try:
            for key in path:
                if not isinstance(node, (dict, list)):
                    raise TypeError  # a string is indexable too, but not editable
                parent, node = node, node[key]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced this position
        if not path:
            doc = draw(JSON_VALUES)
            continue
        key = path[-1]
        action = draw(st.sampled_from(["replace", "delete", "duplicate", "add-key"]))
        if action == "replace":
            parent[key] = draw(JSON_VALUES)
        elif action == "delete":
            del parent[key]
        elif action == "duplicate" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        elif action == "add-key" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(JSON_VALUES)
    return doc


@st.composite
def textual(draw: st.DrawFn, text: str, max_edits: int = 4) -> str:
    """`text` with 1..max_edits character-level edits: cuts, insertions of JSON-significant
    characters, replacements, truncation."""
    for _ in range(draw(st.integers(1, max_edits))):
        i = draw(st.integers(0, len(text)))
        action = draw(st.sampled_from(["cut", "insert", "replace", "truncate"]))
        snippet = draw(st.text(alphabet='{}[]",:0123456789-.eE \\ntrufalsn\u00ff', min_size=1, max_size=4))
        if action == "cut":
            text = text[:i] + text[i + draw(st.integers(1, 40)):]
        elif action == "insert":
            text = text[:i] + snippet + text[i:]
        elif action == "replace":
            text = text[:i] + snippet + text[i + len(snippet):]
        else:
            text = text[:i]
    return text
