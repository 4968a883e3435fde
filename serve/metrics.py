"""GET /metrics: the server's figures in Prometheus' text format (version 0.0.4), as vLLM and
llama.cpp's server expose theirs, so any scraper reads them without an adapter.

The engine's gauges and counters (rows busy and free, requests waiting, accepted, refused,
finished, cancelled, tokens), each stage's restarts, the HTTP responses by status code, and one
`tvmpipe_stage_info` sample per stage naming the process that runs it (pid, host): what an
operator needs to see a disconnect free its row, a queue fill up, or a stage come back after a
fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from tvmpipe.generation.engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Counters:
    """What the HTTP side counts (the event loop's thread only)."""

    responses: dict[int, int] = field(default_factory=dict)  # status code -> responses
    prompt_tokens: int = 0

    def response(self, status: int) -> None:
        self.responses[status] = self.responses.get(status, 0) + 1


@dataclass(frozen=True)
class StageInfo:
    stage: int
    pid: int | None  # None: the stage did not answer (restarting, dead)
    host: str | None = None


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(name: str, value: float, labels: dict[str, Any] | None = None) -> str:
    tags = ",".join(f'{k}="{_label(v)}"' for k, v in (labels or {}).items())
    return f"{name}{{{tags}}} {value:g}" if tags else f"{name} {value:g}"


def render(model: str, stats: EngineStats, counters: Counters, stages: Iterable[StageInfo]) -> str:
    """The exposition text."""
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, Any] | None, float]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(_sample(name, v, labels) for labels, v in samples)

    m = {"model": model}
    metric("tvmpipe_requests_running", "gauge", "Sequences in a row of the pipeline.", [(m, stats.running)])
    metric("tvmpipe_requests_waiting", "gauge", "Requests accepted and waiting for a row.", [(m, stats.waiting)])
    metric("tvmpipe_rows", "gauge", "Sequence rows the pipeline holds (slots x batch).", [(m, stats.rows)])
    metric("tvmpipe_rows_free", "gauge", "Rows no sequence holds.", [(m, stats.free_rows)])
    metric("tvmpipe_max_waiting", "gauge", "Requests that may wait while every row is busy (past it: 429).",
           [(m, stats.max_waiting)])
    metric("tvmpipe_requests_submitted_total", "counter", "Requests accepted by the engine.", [(m, stats.submitted)])
    metric("tvmpipe_requests_rejected_total", "counter", "Requests refused because the wait queue was full (429).",
           [(m, stats.rejected)])
    metric("tvmpipe_requests_finished_total", "counter", "Sequences that ended, for any reason.", [(m, stats.finished)])
    metric("tvmpipe_requests_cancelled_total", "counter",
           "Sequences cancelled before their end (a client that disconnected, a drain).", [(m, stats.cancelled)])
    metric("tvmpipe_generation_tokens_total", "counter", "Tokens generated.", [(m, stats.generated_tokens)])
    metric("tvmpipe_prompt_tokens_total", "counter", "Prompt tokens of the requests accepted.",
           [(m, counters.prompt_tokens)])
    metric("tvmpipe_stage_restarts_total", "counter", "Restarts of each pipeline stage after a fault.",
           [({**m, "stage": i}, n) for i, n in enumerate(stats.stage_restarts)])
    metric("tvmpipe_stage_info", "gauge", "The process that runs each stage now.",
           [({**m, "stage": s.stage, "pid": s.pid if s.pid is not None else "", "host": s.host or ""}, 1)
            for s in stages])
    if stats.kv is not None:  # a paged step: one pool per stage, the same page ids on every stage
        kv, per_stage = stats.kv, range(len(stats.stage_restarts))
        for name, kind, help_, value in (
                ("tvmpipe_kv_tokens_total", "gauge", "Tokens each stage's KV page pool holds.", kv.kv_tokens_total),
                ("tvmpipe_kv_tokens_held", "gauge", "Tokens of the pool in pages sequences hold now.", kv.kv_tokens_held),
                ("tvmpipe_kv_tokens_cached", "gauge", "Tokens of the pool in full pages nobody holds, kept for a "
                 "later prompt alike.", kv.kv_tokens_cached),
                ("tvmpipe_kv_pages_shared", "gauge", "Pages held by more than one sequence (a shared prompt prefix).",
                 kv.kv_pages_shared),
                ("tvmpipe_kv_prefix_hit_tokens_total", "counter", "Prompt tokens whose KV came from cached pages.",
                 kv.kv_prefix_hit_tokens)):
            metric(name, kind, help_, [({**m, "stage": i}, value) for i in per_stage])
    metric("tvmpipe_draining", "gauge", "1 while the server drains after SIGTERM.", [(m, int(stats.draining))])
    metric("tvmpipe_pipeline_failed", "gauge", "1 once the pipeline failed for good.", [(m, int(stats.failed is not None))])
    metric("tvmpipe_http_responses_total", "counter", "HTTP responses by status code.",
           [({"code": code}, n) for code, n in sorted(counters.responses.items())])
    return "\n".join(out) + "\n"


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of an exposition text: (name, sorted labels) -> value. For tests and tools
    reading /metrics without a Prometheus client (label values without escaped quotes or commas)."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = []
        for pair in filter(None, rest.rstrip("}").split(",")):
            k, _, v = pair.partition("=")
            labels.append((k, v.strip('"')))
        samples[name, tuple(sorted(labels))] = float(value)
    return samples
