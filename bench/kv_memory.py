"""KV-cache memory of a decode pipeline: what each stage holds, against sequence slots and stages.

    python bench/kv_memory.py [--quick] [--bundle DIR] [--out bench/results/kv_memory.json]

Each stage keeps the caches of its own layers only, allocated when a slot is first used: one
buffer a pair and slot where the step writes the new value over the old (a decode step's cache
update), else two (it reads one and writes the other, then they swap: docs/generation.md). The
bench compiles the zoo's Llama decode step with a 1024-token context and static caches (`tvmpipe
compile llama --decode --max-context 1024 --kv static`: 2 layers, 512 KiB of caches per slot;
compiled once into --bundle; bench/kv.py measures the paged layout),
runs it at K = 1, 2, 4 stages (stage processes, reference backend) with S = 1, 8, 32 slots, all in
use (S one-token prompts, S in flight), and records per stage:
- the state bytes the stage reports (`WorkerStats.state_bytes`, the `state resident` column of
  `tvmpipe generate`);
- its resident memory's growth (VmRSS of the stage process, after its warm-up and after the run);
- the driver's growth over the run (this process, from the pipeline's start to its last token);
- and, from the smallest S to the largest, what one more slot costs each stage, resident, against
  the buffers it reports for a slot (`inspect`'s "state held").
Targets, at every K and S: each stage's growth equals its reported state bytes' growth within
10% + 4 MiB; the stages' reported bytes add up to K = 1's (the caches are split, not copied); and
the driver holds no cache: its growth stays under 16 MiB.
Writes bench/results/kv_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from stamp import stamp  # noqa: E402  (when, commit, machine: bench/perfpage.py reads them)

MAX_CONTEXT = 1024
SLACK, SLACK_BYTES, DRIVER_MAX = 0.10, 4 << 20, 16 << 20
MiB = 1 << 20


def rss(pid: int) -> int:
    """VmRSS of `pid` in bytes (bigmodel.proc_status: the process is alive, so it has one)."""
    from bigmodel import proc_status

    return proc_status(pid)["VmRSS"] * 1024


def bundle_at(path: Path) -> Path:
    """The Llama decode step at MAX_CONTEXT with static caches (per slot: what this bench measures),
    compiled once (TVM: the project's dev install)."""
    if not (path / "bundle.json").is_file():
        from tvmpipe.compiler.export import compile_model

        compile_model("llama", path, decode=MAX_CONTEXT, overwrite=True, kv="static")
    return path


def measure(bundle_dir: Path, k: int, slots: int) -> dict:
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator
    from tvmpipe.partition import checked_plan

    b = load_bundle(bundle_dir)
    plan = checked_plan(b, k)
    with Pipeline(b, plan, backend="reference", launcher="process", slots=slots, window=max(2 * k, slots)) as pipe:
        before = pipe.record().worker_stats
        driver0 = rss(os.getpid())
        rss0 = [rss(s.pid) for s in before]
        res = Generator(pipe).generate_all([[i % b.generation.vocab_size] for i in range(slots)], 2, in_flight=slots)
        after = pipe.record().worker_stats
        rss1 = [rss(s.pid) for s in after]
        driver1 = rss(os.getpid())
    stages = []
    for i, (s0, s1, r0, r1) in enumerate(zip(before, after, rss0, rss1)):
        grew, held = r1 - r0, s1.state_bytes - s0.state_bytes
        stages.append({"stage": i, "nodes": list(plan.stages[i]), "state_bytes": s1.state_bytes,
                       "state_bytes_before": s0.state_bytes, "rss_growth_bytes": grew,
                       "rss_bytes": r1, "weight_bytes": s1.weight_bytes,
                       "growth_matches": abs(grew - held) <= SLACK * held + SLACK_BYTES})
    return {"stages_k": k, "slots": slots, "tokens": sum(len(r.tokens) for r in res),
            "state_bytes_total": sum(s["state_bytes"] for s in stages),
            "state_bytes_per_slot": b.state_bytes_per_slot, "driver_growth_bytes": driver1 - driver0,
            "stages": stages}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="S = 1, 8 only")
    ap.add_argument("--bundle", type=Path, default=Path("/tmp/tvmpipe-bench-kv-llama"),
                    help="where the decode step is compiled (reused when present)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv_memory.json")
    args = ap.parse_args()
    bundle_dir = bundle_at(args.bundle)
    rows = []
    for slots in (1, 8) if args.quick else (1, 8, 32):
        for k in (1, 2, 4):
            r = measure(bundle_dir, k, slots)
            rows.append(r)
            print(f"K={k} S={slots}: state per stage " + ", ".join(
                f"{s['state_bytes'] / MiB:.2f}" for s in r["stages"]) + " MiB; RSS growth per stage " + ", ".join(
                f"{s['rss_growth_bytes'] / MiB:.2f}" for s in r["stages"]) + f" MiB; driver "
                f"{r['driver_growth_bytes'] / MiB:+.2f} MiB", flush=True)
    lo, hi = min(r["slots"] for r in rows), max(r["slots"] for r in rows)
    per_slot = []  # what one more slot costs each stage, resident, against its reported caches
    for k in (1, 2, 4):
        a, z = (next(r for r in rows if r["stages_k"] == k and r["slots"] == s) for s in (lo, hi))
        per_slot.append({"stages_k": k, "rss_bytes_per_slot": [(sz["rss_growth_bytes"] - sa["rss_growth_bytes"]) / (hi - lo)
                                                               for sa, sz in zip(a["stages"], z["stages"])],
                         "state_bytes_per_slot": [(sz["state_bytes"] - sa["state_bytes"]) / (hi - lo)
                                                  for sa, sz in zip(a["stages"], z["stages"])]})
        print(f"K={k}: one more slot costs each stage " + ", ".join(
            f"{m / MiB:.3f}" for m in per_slot[-1]["rss_bytes_per_slot"]) + " MiB resident; its buffers "
            + ", ".join(f"{m / MiB:.3f}" for m in per_slot[-1]["state_bytes_per_slot"]) + " MiB")
    ok_growth = all(s["growth_matches"] for r in rows for s in r["stages"])
    ok_split = all(r["state_bytes_total"] == next(q["state_bytes_total"] for q in rows
                                                  if q["slots"] == r["slots"] and q["stages_k"] == 1) for r in rows)
    ok_driver = all(r["driver_growth_bytes"] < DRIVER_MAX for r in rows)
    print(f"each stage's memory grows by the caches it reports (within {SLACK:.0%} + {SLACK_BYTES // MiB} MiB): "
          f"{'PASS' if ok_growth else 'FAIL'}")
    print(f"the stages' caches add up to K = 1's at every S (split, not copied): {'PASS' if ok_split else 'FAIL'}")
    print(f"the driver holds no cache (growth < {DRIVER_MAX // MiB} MiB): {'PASS' if ok_driver else 'FAIL'}")
    doc = {"bench": "kv_memory", "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                             "python": platform.python_version()},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "quick": args.quick,
           "bundle": {"source": "llama --decode", "max_context": MAX_CONTEXT},
           "target": {"growth_matches": ok_growth, "split_not_copied": ok_split, "driver_holds_no_cache": ok_driver},
           "rows": rows, "per_slot": per_slot}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(stamp(doc), indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if ok_growth and ok_split and ok_driver else 1


if __name__ == "__main__":
    sys.exit(main())
