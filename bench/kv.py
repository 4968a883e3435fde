"""Paged against static KV (issue 53), the part that needs no scheduler: a decode step's time against
the tokens it holds, on the reference backend.

    python bench/kv.py [--quick] [--out bench/results/kv.json]

Compiles the zoo's Llama decode step (2 layers, 2 KV heads of 16, vocabulary 128; `--batch 8`) at
two max contexts, T = 64 and T = 2048, in both layouts (`--kv static` and `--kv paged`, page size 16,
the default pool: every row at T), and times one step of 8 rows each holding 64 tokens, through a
Stage keeping its state resident (as a pipeline's stage does: no cache is fed or sent), best of
--repeat runs. The static step writes and attends over all T positions a row; the paged one appends
each row's token to its page and attends over the row's 64 tokens through the page table, so its
time should follow the tokens held, not T: the issue's target is paged(T = 2048) <= 1.2 x
paged(T = 64) at 64 tokens held. `--quick` uses T = 64 and 256.

Not here yet (they need the scheduler to drive the page table, docs/paged-kv.md): rows at a fixed
memory, prefix TTFT, and these times on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from stamp import stamp  # noqa: E402

BATCH, PAGE, HELD = 8, 16, 64
TARGET = 1.2


def step_ms(bundle_dir: Path, repeat: int) -> float:
    """Best time of one step, 8 rows of HELD tokens each, its state resident in a Stage."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor.stage import Stage
    from tvmpipe.generation.pages import PagePool, RowWrite, step_pages

    b = load_bundle(bundle_dir)
    st = Stage(b, 0, len(b.graph.nodes), "reference", state_slots=1)
    feeds = {"input_ids": np.ones((BATCH, 1), np.int64), "position": np.full(BATCH, HELD - 1, np.int64)}
    if b.generation.paged is not None:
        pool = PagePool(b.generation.paged.pages, PAGE)
        for s in range(BATCH):
            pool.reserve(s, [], HELD)
        sp = step_pages(pool, [RowWrite(s, HELD - 1, 1) for s in range(BATCH)], 1,
                        b.graph.entry_of("page_table_values").shape[0])
        for k in ("page_table_indptr", "page_table_values", "last_page_len", "position_map"):
            feeds[k] = np.array(getattr(sp, k), np.int32)
    inputs = {e: feeds[n] for n, e in st.program.input_entries.items() if e not in st.state.inputs}
    inputs[st.slot_entry] = np.array([0] + [0] * BATCH, np.int64)
    st.run(dict(inputs))
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        st.run(dict(inputs))
        best = min(best, time.perf_counter() - t)
    st.close()
    return best * 1e3


def run(contexts: tuple[int, int], repeat: int, work: Path) -> dict:
    from tvmpipe.compiler.decoders import KvOptions
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    times: dict[str, dict[str, float]] = {"static": {}, "paged": {}}
    for t in contexts:
        for kv in ("static", "paged"):
            out = work / f"{kv}_{t}"
            export("llama", decode=t, batch=BATCH, seed=1, progress=Progress(stream=None),
                   kv=KvOptions("paged", page_size=PAGE) if kv == "paged" else None).write(out, overwrite=True)
            times[kv][str(t)] = step_ms(out, repeat)
            print(f"{kv:6s} T = {t:5d}: {times[kv][str(t)]:.2f} ms a step ({HELD} tokens held a row)", flush=True)
    lo, hi = (str(c) for c in contexts)
    ratio = {kv: times[kv][hi] / times[kv][lo] for kv in times}
    print(f"T = {hi} over T = {lo}: paged {ratio['paged']:.2f}x (target <= {TARGET}), static {ratio['static']:.2f}x")
    return {"what": "decode step time against tokens held, reference backend, Stage with resident state",
            "model": "llama (tiny: 2 layers, 2 KV heads x 16)", "batch": BATCH, "page_size": PAGE,
            "tokens_held": HELD, "repeat": repeat, "step_ms": times, "ratio": ratio,
            "target": TARGET, "met": ratio["paged"] <= TARGET}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T = 64 and 256, fewer repeats")
    ap.add_argument("--repeat", type=int, default=None, help="runs timed a step (best taken; default 60, quick 5)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/kv.json unless --quick)")
    args = ap.parse_args()
    contexts = (HELD, 256) if args.quick else (HELD, 2048)
    repeat = args.repeat or (5 if args.quick else 60)
    with tempfile.TemporaryDirectory(prefix="tvmpipe-kv-") as work:
        result = run(contexts, repeat, Path(work))
    out = args.out or (None if args.quick else ROOT / "bench" / "results" / "kv.json")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(stamp(result), indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
