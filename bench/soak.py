"""A seeded random soak of `tvmpipe serve`, for minutes: the workload of tests/serve/test_soak.py
(tests/support/soak.py) run long, against a real `python -m tvmpipe serve` child process.

    python bench/soak.py [--minutes 10] [--seed N] [--concurrency 8] [--exclude CASE,...]
                         [--bundle DIR] [--strict] [--out bench/results/soak.json]

The decode step is the zoo's GPT-2 (`tvmpipe compile gpt2 --decode`, max context 64), compiled once
into --bundle, served by 2 stage processes (4 rows) with --max-waiting 6 and a ChatML tokenizer made
by tests/serve/harness.py. The plan of the seed is sent until the minutes are up: completions and
chats, streamed and whole, greedy and seeded sampling, stop strings and stop_token_ids, clients that
close or cancel at random moments, extreme and invalid bodies, probes, a burst past rows +
--max-waiting every --burst-every actions (429s expected), one SIGKILL of a stage at action
--kill-at, and at the end SIGTERM (exit 0). Afterwards every answer is checked (greedy and seeded
tokens against an offline run on a pipeline of its own, forms, statuses), as are the rows (all
free), the server process's threads and fds against its steady state, and /dev/shm.

Prints a summary (every problem grouped, with the first request that showed it) and writes it to
--out; with --strict, exits 1 when there was a problem (`make bench` runs it without: a bench reports,
tests/serve/test_soak.py judges).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from stamp import stamp  # noqa: E402  (when, commit, machine: bench/perfpage.py reads them)

MAX_WAITING = 6


def ensure_bundle(path: Path) -> Path:
    """The zoo's GPT-2 decode step at max context 64, compiled once (as `tvmpipe compile gpt2 --decode`)."""
    if not (path / "bundle.json").is_file():
        from tvmpipe.compiler.export import export
        from tvmpipe.compiler.progress import Progress

        print(f"compiling gpt2 --decode into {path} ...", flush=True)
        export("gpt2", progress=Progress(stream=None), decode=64, seed=1).write(path)
    return path


def offline_reference(bundle: Path, cases: list) -> dict:
    """Each (prompt ids, sampling) case's full continuation (to the context, no stop token), keyed
    0 as a served request is, from Generator on a 2-stage pipeline of its own."""
    if not cases:
        return {}
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator, layout_of
    from tvmpipe.generation.requests import Request

    # a paged step's pool sized as tvmpipe generate sizes it (the compiled one holds one row)
    with Pipeline(bundle, 2, launcher="process", logits=False, kv_tokens="auto") as pipe:
        layout = layout_of(pipe.bundle)
        requests = [Request.checked(list(p), layout.max_context - len(p), layout, sampling=s, key=0) for p, s in cases]
        results = Generator(pipe).generate_all(requests)
    return {case: r.tokens for case, r in zip(cases, results)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="how long the plan is sent (default 3)")
    ap.add_argument("--seed", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=8, help="actions in flight at most (bursts aside)")
    ap.add_argument("--kill-at", type=int, default=1000, help="the action at which a stage is SIGKILLed (once)")
    ap.add_argument("--burst-every", type=int, default=400)
    ap.add_argument("--exclude", default="", help="bad cases (tests/support/soak.py BAD_CASES names) left out")
    ap.add_argument("--bundle", type=Path, default=Path("/tmp/tvmpipe-bench-serve-gpt2"))
    ap.add_argument("--note", default="", help="a line kept in the results (what code was measured, why)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when there was a problem (default: report it)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = ap.parse_args()

    from tests.serve.harness import ServerProcess, build_tokenizer, metric
    from tests.support.soak import Soak, reference_cases, report, verify

    t0 = time.time()

    def log(line: str) -> None:
        print(f"{time.time() - t0:7.1f} s  {line}", flush=True)

    bundle = ensure_bundle(args.bundle)
    work = Path(tempfile.mkdtemp(prefix="tvmpipe-soak-"))
    tok = build_tokenizer(work / "tok")
    srv = ServerProcess(bundle, "--stages", "2", "--processes", "--tokenizer", str(tok), "--max-waiting", str(MAX_WAITING),
                        "--drain-timeout", "30", log_path=work / "stderr.txt")
    exclude = frozenset(filter(None, args.exclude.split(",")))
    try:
        rows = int(metric(srv.metrics(), "tvmpipe_rows"))
        log(f"server up ({srv.url}, {rows} rows, log {work / 'stderr.txt'}); seed {args.seed}, {args.minutes:g} min")
        soak = Soak(srv, args.seed, rows=rows, max_waiting=MAX_WAITING, seconds=args.minutes * 60,
                    deadline_s=args.minutes * 60 + 120, concurrency=args.concurrency, kill_at=args.kill_at,
                    burst_every=args.burst_every, exclude=exclude, log=log)
        soak.run()
        log(f"plan sent: {soak.sent} actions, {len(soak.records)} requests in {soak.t_soak:.1f} s")
        end = soak.finish()
        log(f"drained: exit {end.get('exit_status')}")
    finally:
        srv.kill()
    cases = reference_cases(soak.records)
    t = time.time()
    reference = offline_reference(bundle, cases)
    log(f"offline reference: {len(cases)} continuations in {time.time() - t:.1f} s")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok / "tokenizer.json"))
    problems, counts = verify(soak.records, reference, server_died=soak.server_died is not None,
                              decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    everything = soak.problems + problems
    results = {
        "note": args.note, "seed": args.seed, "minutes": args.minutes, "concurrency": args.concurrency, "rows": rows,
        "max_waiting": MAX_WAITING, "excluded": sorted(exclude), "actions_sent": soak.sent,
        "requests": len(soak.records), "soak_s": soak.t_soak, "health_checks": soak.health_checks,
        "killed": soak.killed, "server_died": soak.server_died, "counts": dict(sorted(counts.items())),
        "end": end, "notes": soak.notes, "problems": len(everything),
        "problem_groups": report(everything).splitlines(),
        "machine": {"loadavg": list(os.getloadavg())},
    }
    from tvmpipe.core.files import write_json

    write_json(args.out, stamp(results))
    print(f"\nanswers: {results['counts']}")
    print(f"server process: {end.get('process')}; server exceptions: {end.get('server_exceptions')}")
    if everything:
        print(f"\nseed {args.seed}: {len(everything)} problem(s)\n{report(everything)}")
    else:
        print(f"\nseed {args.seed}: no problem in {soak.sent} actions")
    print(f"wrote {args.out}")
    return 1 if everything and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
