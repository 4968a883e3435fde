"""Generation over stateful stages (issue 24): token-exact against a single-process greedy loop,
KV caches resident on the stages (never on the data plane), continuous admission, a killed stage
mid-generation, and one-line errors for bad prompts, options and plans."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests.support.decode_bundle import runner_greedy, torch_greedy

from tvmpipe.bundle import load_bundle
from tvmpipe.cluster.control.launchers import Timeouts
from tvmpipe.cluster.driver import Pipeline
from tvmpipe.generation import FinishReason, GenerationError, Generator
from tvmpipe.cluster.wire.frames import DRIVER
from tvmpipe.bundle.decode_layout import FEED_NEXT, FROM, NO_SAMPLING, decode_layout, encode_step, row_ints
from tvmpipe.bundle.state import state_spans
from tvmpipe.cluster.topology import build_topology, relay_inputs
from tvmpipe.core.errors import FieldError, TvmpipeError
from tvmpipe.core.units import format_bytes
from tvmpipe.partition import Plan, checked_plan

PROMPTS = [[5, 17, 3], [60], [1, 2, 3, 4, 5, 6], [9, 9], [33, 0, 12]]
NEW = 6


@pytest.fixture(scope="module")
def oracle(decode_bundle):
    b = load_bundle(decode_bundle)
    return {i: runner_greedy(b, p, NEW) for i, p in enumerate(PROMPTS)}


def test_the_fixture_equals_torch_eager(decode_bundle, oracle):
    """The compiled decode step's greedy loop (GraphRunner, caches fed by hand) is torch eager's."""
    for i in (0, 2):
        want, logits = torch_greedy(PROMPTS[i], NEW)
        assert oracle[i][0] == want
        for pos, ref in enumerate(logits):
            assert np.abs(oracle[i][1][pos] - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_token_streams_equal_the_single_process_loop(decode_bundle, oracle, k):
    """K = 1, 2, 3 on the reference backend, 5 prompts through 3 slots (the rest queue and are
    admitted as others finish): every sequence's tokens equal the oracle's, logits at every step
    within 1e-4 x max|ref|; events of each sequence arrive in order; no cache byte on the data plane."""
    with Pipeline(decode_bundle, k, launcher="process", slots=3) as pipe:
        assert pipe.plan.num_stages == k and len(pipe.topology.stateful) == min(k, 2)  # 2 layers
        results, logs = {}, {}
        events = list(Generator(pipe).generate(PROMPTS, NEW, results=results, logits_log=logs))
        rec = pipe.record()
    for i, p in enumerate(PROMPTS):
        assert results[i].prompt == p and results[i].tokens == oracle[i][0], i
        assert results[i].finish == "length"
        for pos, ref in oracle[i][1].items():
            assert np.abs(logs[i][pos] - ref).max() <= 1e-4 * np.abs(ref).max(), (i, pos)
        mine = [e for e in events if e.seq == i]
        assert [e.index for e in mine] == list(range(NEW)) and [e.token for e in mine] == oracle[i][0]
        assert [e.done for e in mine] == [False] * (NEW - 1) + [True]
    # continuous admission: a queued sequence's first token comes before the first ones' last
    first_of = {i: next(n for n, e in enumerate(events) if e.seq == i) for i in range(len(PROMPTS))}
    last_of = {i: max(n for n, e in enumerate(events) if e.seq == i) for i in range(len(PROMPTS))}
    assert min(first_of[3], first_of[4]) > min(last_of.values()) - 1
    # no cache bytes cross the data plane: every frame is token/position/slot or a hidden state/logits
    b = load_bundle(decode_bundle)
    cache = b.state_bytes_per_slot
    for src, dst, nbytes in rec.edges:
        assert nbytes < cache // len(b.state), (src, dst, nbytes)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_each_stage_reports_the_caches_it_holds(decode_bundle, k):
    """WorkerStats.state_bytes (the `state resident` column): the buffers of every pair the stage
    holds (one each: the fixture's caches are updated in place), per slot used so far (slot 0 from
    the warm-up, then one per sequence in flight, never the unused ones); the stages' add up to one
    process's: the caches are split, not copied."""
    b = load_bundle(decode_bundle)
    assert set(b.state_buffers.values()) == {1}
    pair = b.state_bytes_per_slot // len(b.state)
    with Pipeline(decode_bundle, k, launcher="process", slots=5) as pipe:
        stage_of = {n: i for i, (s, e) in enumerate(pipe.plan.stages) for n in range(s, e)}
        held = [sum(1 for lo, _ in state_spans(b.graph, b.state).values() if stage_of[lo] == i) for i in range(k)]
        before = [s.state_bytes for s in pipe.record().worker_stats]
        Generator(pipe).generate_all(PROMPTS[:3], 2, in_flight=3)
        metrics = pipe.metrics()
    assert before == [1 * pair * n for n in held]
    assert [s.state_bytes for s in metrics.stages] == [3 * pair * n for n in held]
    assert sum(s.state_bytes for s in metrics.stages) == 3 * b.state_bytes_per_slot
    table = metrics.table().splitlines()
    assert table[0].split()[-2:] == ["state", "resident"] and len(table) == k + 1


def test_pairs_kept_in_two_buffers_give_the_same_tokens(decode_bundle, oracle, monkeypatch):
    """A pair that cannot be updated in place (any update other than an elementwise write of the
    cache) is read from one buffer and written to the other: the same tokens at twice the bytes."""
    from tests.support.pipeline_harness import ThreadLauncher

    monkeypatch.setattr("tvmpipe.bundle.state.updated_in_place", lambda *a: False)
    b = load_bundle(decode_bundle)
    assert b.state_resident_bytes_per_slot == 2 * b.state_bytes_per_slot
    with Pipeline(b, 2, launcher=ThreadLauncher(), slots=3) as pipe:
        res = Generator(pipe).generate_all(PROMPTS, NEW)
        assert sum(s.state_bytes for s in pipe.metrics().stages) == 3 * 2 * b.state_bytes_per_slot
    assert [r.tokens for r in res] == [oracle[i][0] for i in range(len(PROMPTS))]


def test_more_slots_than_memory_holds_are_refused_before_any_is_allocated(decode_bundle, tmp_path, monkeypatch):
    """Slots are allocated as sequences first use them, so a --slots the memory cannot hold would
    be an OOM mid-run: each stage refuses it when it is built, in one line naming the stage, the
    bytes and the most slots that fit (host memory on the reference backend, the device's free
    memory on cuda: the strict fake driver's cuMemGetInfo)."""
    pytest.importorskip("tvm")
    from tests.support.fake_cuda import activate
    from tests.support.pipeline_harness import ThreadLauncher

    b = load_bundle(decode_bundle)
    slots = 10**9  # a slot of either stage is a few KiB: terabytes in all
    with pytest.raises(TvmpipeError) as err:
        Pipeline(b, 2, launcher="process", slots=slots, max_restarts=0)
    msg = str(err.value)
    assert "\n" not in msg and "stage [0, " in msg and f"{slots} state slot(s)" in msg and "of host memory free" in msg
    fit = int(msg.rsplit("use at most ", 1)[1].split()[0])
    assert 0 < fit < slots
    activate(monkeypatch, tmp_path, [decode_bundle])
    with pytest.raises(TvmpipeError, match=r"of device memory free; use at most \d+ slots"):
        Pipeline(b, 2, backend="cuda", launcher=ThreadLauncher(), slots=slots, max_restarts=0)


def test_a_slot_the_memory_no_longer_holds_is_a_one_line_error(decode_bundle, monkeypatch):
    """check_fits sees what is free when a stage is built; stages sharing the memory may take it
    before a slot is first used. A new slot is allocated only while the memory free still holds it
    and SLOT_HEADROOM more: otherwise that step fails with a one-line error naming the stage and the
    slot (the OOM killer would have taken a stage instead). The failure is the sequence's that the
    slot was for, not the pipeline's: it ends with FinishReason.ERROR carrying the message (after
    one retry), and the sequences in the slots that fit finish."""
    from tests.support.pipeline_harness import ThreadLauncher
    from tvmpipe.executor.backend_reference import ReferenceBackend

    calls: dict[int, int] = {}

    def free_memory(self):  # per stage: the build's check and slots 0 (warm-up) and 1 fit, then 1 MiB is left
        calls[id(self)] = calls.get(id(self), 0) + 1
        return 10 << 30 if calls[id(self)] <= 3 else 1 << 20

    monkeypatch.setattr(ReferenceBackend, "free_memory", free_memory)
    with Pipeline(decode_bundle, 2, launcher=ThreadLauncher(), slots=3, max_restarts=0) as pipe:
        results = Generator(pipe).generate_all(PROMPTS[:3], NEW, in_flight=3)
        # the step and its retry (and steps of that slot submitted before the failure came back); no restart
        assert pipe.restarts == [0, 0] and len(pipe.step_errors) >= 2
        assert all("no memory for slot 2's caches" in e for e in pipe.step_errors)
    failed = [r for r in results if r.finish == FinishReason.ERROR]
    assert len(failed) == 1 and [r.finish for r in results].count(FinishReason.LENGTH) == 2, results
    msg = failed[0].error
    assert "no memory for slot 2's caches" in msg and "1.0 MiB free" in msg and "\n" not in msg, msg


def test_more_sequences_than_slots_are_queued(decode_bundle, oracle):
    with Pipeline(decode_bundle, 2, launcher="process", slots=1) as pipe:
        res = Generator(pipe).generate_all(PROMPTS[:3], NEW, in_flight=8)
    assert [r.tokens for r in res] == [oracle[i][0] for i in range(3)]


def test_stop_tokens_context_and_sampling(decode_bundle, oracle):
    """A stop token ends a sequence (and is its last token); a full cache ends it with 'context';
    seeded sampling gives the same streams whatever the number in flight."""
    stop = oracle[0][0][2]
    b = load_bundle(decode_bundle)
    long = [1] * (b.generation.max_context - 2)
    with Pipeline(decode_bundle, 2, launcher="process", slots=3) as pipe:
        r = Generator(pipe).generate_all([PROMPTS[0], long], 10, stop_tokens=[stop])
        a = Generator(pipe).generate_all(PROMPTS, NEW, temperature=0.8, top_k=10, seed=7, in_flight=3)
        c = Generator(pipe).generate_all(PROMPTS, NEW, temperature=0.8, top_k=10, seed=7, in_flight=1)
    assert r[0].tokens == oracle[0][0][:3] and r[0].finish == "stop"
    assert len(r[1].tokens) == 3 and r[1].finish == "context"
    assert [x.tokens for x in a] == [x.tokens for x in c]
    assert [x.tokens for x in a] != [oracle[i][0] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("victim", [0, 2])
def test_a_killed_stage_mid_generation_leaves_the_streams_unchanged(decode_bundle, oracle, victim):
    """Stage `victim` of 3 is SIGKILLed after 8 tokens: it is restarted without its caches, every
    sequence in flight replays its prompt and tokens so far, and every stream equals the oracle's."""
    with Pipeline(decode_bundle, 3, launcher="process", slots=3, timeouts=Timeouts(progress=20)) as pipe:
        results = {}
        for n, _ in enumerate(Generator(pipe).generate(PROMPTS, NEW, results=results)):
            if n == 8:
                pipe.launcher.kill(victim)
        assert pipe.restarts[victim] == 1 and pipe.state_losses == 1
    assert [results[i].tokens for i in range(len(PROMPTS))] == [oracle[i][0] for i in range(len(PROMPTS))]
    assert sum(r.replays for r in results.values()) >= 1


def test_completed_sequences_are_kept_when_the_run_fails(decode_bundle, oracle):
    with Pipeline(decode_bundle, 2, launcher="process", slots=1, max_restarts=0,
                  timeouts=Timeouts(progress=20)) as pipe:
        results = {}
        with pytest.raises(GenerationError) as exc:
            for _ in Generator(pipe).generate(PROMPTS[:3], NEW, results=results):
                if len(results) == 1 and 1 not in results:
                    pipe.launcher.kill(1)
    assert "\n" not in str(exc.value) and "stage 1" in str(exc.value)
    assert list(exc.value.finished) == [0] and exc.value.finished[0].tokens == oracle[0][0]


def test_a_plan_splitting_a_state_pair_is_refused_in_one_line(decode_bundle):
    b = load_bundle(decode_bundle)
    (lo, hi) = state_spans(b.graph, b.state)["k0"]
    ops = b.graph.op_nodes
    cut = next(c for c in range(1, len(ops)) if lo < ops[c - 1] + 1 <= hi)
    with pytest.raises(TvmpipeError) as exc:
        build_topology(b, Plan.from_cuts(b.graph, [cut]))
    assert "\n" not in str(exc.value) and "splits state pair 'k0'" in str(exc.value)
    for k in (2, 3, 4):  # the default plans move their cuts off the pairs
        build_topology(b, checked_plan(b, k))


def test_bad_prompts_and_options_are_one_line_errors(decode_bundle):
    b = load_bundle(decode_bundle)
    ctx, vocab = b.generation.max_context, b.generation.vocab_size
    with Pipeline(decode_bundle, 1, launcher="process", slots=2) as pipe:
        cases = [([[1] * (ctx + 1)], {}, "max_context"), ([[vocab]], {}, "outside the vocabulary"),
                 ([[]], {}, "empty"), ([], {}, "no prompts"), ([[1]], {"in_flight": 0}, "in_flight"),
                 ([[1]], {"temperature": -1.0}, "temperature"), ([[1]], {"top_k": vocab + 1}, "top_k"),
                 ([[1]], {"stop_tokens": [-1]}, "stop_tokens"), ([[1]], {"seed": -1}, "seed")]
        for prompts, kw, words in cases:
            with pytest.raises(TvmpipeError) as exc:
                Generator(pipe).generate_all(prompts, 2, **kw)
            assert words in str(exc.value) and "\n" not in str(exc.value), (kw, str(exc.value))
            if isinstance(exc.value, FieldError):  # each front end names the field its own way
                assert exc.value.field == words and exc.value.render({words: f"--{words}"}).startswith(f"--{words} ")
        with pytest.raises(FieldError, match="max_new_tokens"):
            Generator(pipe).generate_all([[1]], 0)
        assert Generator(pipe).generate_all([[1]], 1)[0].tokens  # the pipeline is still fine


def test_cli_generate_prints_one_json_document(decode_bundle, oracle, capsys):
    from tvmpipe.cli import main

    code = main(["generate", str(decode_bundle), "--stages", "2", "--processes", "--prompt-ids", "5,17,3",
                 "--prompt-ids", "60", "--max-new-tokens", str(NEW), "--json"])
    out = capsys.readouterr().out
    assert code == 0
    doc = json.loads(out)
    assert [s["prompt"] for s in doc["sequences"]] == [[5, 17, 3], [60]]
    assert [s["tokens"] for s in doc["sequences"]] == [oracle[0][0], oracle[1][0]]
    assert doc["batch"] == 1  # one sequence a micro-batch
    b = load_bundle(decode_bundle)  # each stage's caches: slots 0 and 1, one layer's pairs, one buffer each
    assert [s["state_bytes"] for s in doc["metrics"]["stages"]] == [2 * b.state_bytes_per_slot // 2] * 2
    code = main(["generate", str(decode_bundle), "--stages", "2", "--processes", "--prompt-ids", "5,17,3",
                 "--max-new-tokens", "2"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[-3].split()[-2:] == ["state", "resident"]  # slot 0 only, in each stage
    assert [" ".join(row.split()[-2:]) for row in out[-2:]] == [format_bytes(b.state_bytes_per_slot // 2)] * 2
    for argv, words in [(["--prompt-ids", "5,x"], "--prompt-ids"), (["--prompt-ids", "99"], "vocabulary"),
                        (["--prompt-ids", "1", "--temperature", "-1"], "--temperature"),
                        (["--prompt", "hello"], "--tokenizer"), (["--prompt-ids", "1", "--top-k", "999"], "--top-k"),
                        (["--prompt-ids", "1", "--seed", "-5"], "--seed")]:
        code = main(["generate", str(decode_bundle), "--processes", *argv])
        err = capsys.readouterr().err
        assert code == 2 and words in err and err.count("\n") == 1, (argv, err)


def test_fake_cuda_state_stays_on_the_device(decode_bundle, oracle, tmp_path, monkeypatch):
    """The strict fake CUDA driver, stages in this process (ThreadLauncher): the tokens equal the
    oracle's at K = 1 and 2 (and with CUDA graphs), and no stage stages a state entry through host
    memory (no host buffer for a state input or output: the slot buffers are device allocations
    that the kernels are pointed at, one per slot and pair, the cache written in place; and, with
    the pairs kept in two buffers, two per slot and pair, swapped each step)."""
    pytest.importorskip("tvm")
    from tests.support.fake_cuda import activate
    from tests.support.pipeline_harness import ThreadLauncher

    activate(monkeypatch, tmp_path, [decode_bundle])
    import pycuda.driver as drv

    b = load_bundle(decode_bundle)
    # graphs: one captured CUDA graph per slot binding; logits=False: as `tvmpipe generate` runs it
    for k, graphs, logits, two in ((1, False, True, False), (2, False, True, False), (2, True, False, False),
                                   (2, True, False, True)):
        monkeypatch.setattr("tvmpipe.bundle.state.updated_in_place", lambda *a: not two)
        launcher = ThreadLauncher()
        with Pipeline(b, k, backend="cuda", backend_opts={"graphs": graphs}, launcher=launcher, slots=2,
                      max_restarts=0, logits=logits) as pipe:
            assert not any(pipe.topology.relayed)  # same-node cuda edges carry device tensors only
            res = Generator(pipe).generate_all(PROMPTS[:3], NEW)
            stages = [w.stage for w in launcher.workers if w is not None]
            for st in stages:
                if st.state is None:
                    continue
                state_entries = {e for _, i, o in st.state.pairs for e in (i, o)}
                assert not state_entries & (set(st.backend.host_in) | set(st.backend.host_out))
                assert all(isinstance(x, int) for bufs in st.state.buffers.values() for buf in bufs for x in buf)
                assert {len(buf) for bufs in st.state.buffers.values() for buf in bufs} == {2 if two else 1}
                assert st.backend._plans  # kernels pointed at the slots' device buffers: no copies
        assert [r.tokens for r in res] == [oracle[i][0] for i in range(3)], k
    assert not drv.violations


def test_an_abandoned_generation_does_not_leak_into_the_next(decode_bundle, oracle):
    with Pipeline(decode_bundle, 2, launcher="process", slots=2) as pipe:
        it = Generator(pipe).generate(PROMPTS[:2], NEW)
        next(it)
        it.close()  # steps of it are still in flight
        res = Generator(pipe).generate_all(PROMPTS[:2], NEW)
    assert [r.tokens for r in res] == [oracle[0][0], oracle[1][0]]


def test_the_optimal_planner_keeps_pairs_whole_and_counts_slots(decode_bundle):
    from tvmpipe.partition import make_plan
    from tvmpipe.partition.errors import PartitionError
    from tvmpipe.partition.model import PipelineModel

    b = load_bundle(decode_bundle)
    one, many = PipelineModel.build(b, state_slots=1), PipelineModel.build(b, state_slots=8)
    n = one.num_ops
    # one buffer per slot and pair (updated in place): 7 more slots add 7 x the cache of a slot
    assert many.stage_memory(0, n) - one.stage_memory(0, n) == 7 * b.state_bytes_per_slot
    for k in (2, 3, 4):
        build_topology(b, make_plan(many, k, "optimal"))  # refused if a pair were split
    with pytest.raises(PartitionError, match="memory caps"):
        make_plan(PipelineModel.build(b, state_slots=1000, memory_caps=[200_000]), 2, "optimal")


def test_partition_counts_the_slots_a_user_asks_for(decode_bundle, capsys):
    """`tvmpipe partition --slots S`: each stage's memory holds S slots of its pairs' caches (one
    buffer each: updated in place), the cap refuses a plan they do not fit, and --slots on a
    bundle without state, or below 1, is one line."""
    from tvmpipe.cli import main

    def stages(*extra):
        assert main(["partition", str(decode_bundle), "--stages", "2", "--strategy", "equal", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["prediction"]["stages"]

    b = load_bundle(decode_bundle)
    one, eight = stages(), stages("--slots", "8")
    assert [e["memory_bytes"] - o["memory_bytes"] for o, e in zip(one, eight)] == [7 * b.state_bytes_per_slot // 2] * 2
    assert main(["partition", str(decode_bundle), "--stages", "2", "--slots", "8", "--memory-per-device",
                 f"{one[0]['memory_bytes'] + 3 * b.state_bytes_per_slot // 2}B"]) == 2
    assert "fits the memory caps" in capsys.readouterr().err
    for path, slots, words in ((decode_bundle, "0", "must be >= 1"),
                               (decode_bundle / "graph.json", "4", "declares no state")):  # a bare graph
        assert main(["partition", str(path), "--stages", "2", "--slots", slots]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_cli_text_prompts_through_a_local_tokenizer_and_split_plans(decode_bundle, tmp_path, capsys):
    """--prompt TEXT with --tokenizer DIR (no download): the prompt's ids and the decoded text are in
    the JSON, and the tokens equal those of the same ids; a --plan that splits a pair is one line."""
    pytest.importorskip("transformers")
    from tests.support.decode_bundle import write_tokenizer
    from tvmpipe.cli import main

    tok = write_tokenizer(tmp_path / "tok")
    want = runner_greedy(load_bundle(decode_bundle), [60, 61, 63], 4)[0]
    code = main(["generate", str(decode_bundle), "--stages", "1", "--processes", "--tokenizer", str(tok),
                 "--prompt", "hello world the", "--max-new-tokens", "4", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["sequences"][0]["prompt"] == [60, 61, 63] and doc["sequences"][0]["tokens"] == want
    assert doc["sequences"][0]["text"].split() == [(["w%d" % i for i in range(60)] + ["hello", "world", "[UNK]", "the"])[t]
                                                   for t in want]
    b = load_bundle(decode_bundle)
    lo, hi = state_spans(b.graph, b.state)["v1"]
    ops = b.graph.op_nodes
    cut = next(c for c in range(1, len(ops)) if lo < ops[c - 1] + 1 <= hi)
    Plan.from_cuts(b.graph, [cut]).save(tmp_path / "plan.json")
    code = main(["generate", str(decode_bundle), "--plan", str(tmp_path / "plan.json"), "--processes",
                 "--prompt-ids", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "splits state pair '" in err and err.count("\n") == 1
    code = main(["generate", str(decode_bundle), "--processes", "--tokenizer", str(tmp_path / "nope"), "--prompt", "x"])
    err = capsys.readouterr().err
    assert code == 2 and "--tokenizer" in err and err.count("\n") == 1


def test_sampled_streams_survive_a_killed_stage(decode_bundle):
    """Seeded top-k sampling: the streams of a run whose stage 1 is SIGKILLed mid-way equal those of
    the same run without the fault (tokens generated before the fault are not drawn again)."""
    kw = dict(temperature=0.8, top_k=10, seed=3)
    with Pipeline(decode_bundle, 2, launcher="process", slots=3, timeouts=Timeouts(progress=20)) as pipe:
        clean = [r.tokens for r in Generator(pipe).generate_all(PROMPTS, NEW, **kw)]
        results = {}
        for n, _ in enumerate(Generator(pipe).generate(PROMPTS, NEW, results=results, **kw)):
            if n == 5:
                pipe.launcher.kill(1)
        assert pipe.restarts == [0, 1]
    assert [results[i].tokens for i in range(len(PROMPTS))] == clean


def test_the_token_goes_from_the_sampling_stage_to_the_token_stage(decode_bundle, oracle):
    """With S <= window / 2 the sampling stage (the last) sends each drawn token straight to stage 0
    on the feedback edge, and the driver submits each next step before the token is known: one
    frame on that edge per generated token (the last of each sequence excepted). With the window
    full of one step per sequence (S = 2K) the driver feeds every token and that edge stays quiet
    while they all run (once only two are left, their last tokens may go on it). Tokens are the
    oracle's either way."""
    with Pipeline(decode_bundle, 2, launcher="process", slots=4) as pipe:
        assert pipe.topology.feedback == (1, 0)
        edges = {(e.src, e.dst): e.entries for e in pipe.topology.edges}
        assert edges[(1, 0)] == (pipe.topology.token_entry,)
        frames = lambda: pipe.record().worker_stats[1].frames_out.get(0, 0)  # noqa: E731
        res = Generator(pipe).generate_all(PROMPTS[:2], NEW, in_flight=2)
        fed = frames()
        res4 = Generator(pipe).generate_all(PROMPTS[:4], NEW, in_flight=4)
        assert frames() - fed < NEW - 1  # not even one sequence's worth
    assert fed == 2 * (NEW - 1)
    assert [r.tokens for r in res] == [oracle[i][0] for i in range(2)]
    assert [r.tokens for r in res4] == [oracle[i][0] for i in range(4)]


def test_the_driver_sends_one_frame_a_step_and_the_stages_pass_it_on(decode_bundle, oracle):
    """A decode step's per-step inputs (slot, step tag, position) reach stage j > 0 with stage j - 1's
    outputs (topology.relay_inputs): the driver sends one frame a step, to stage 0, however many
    stages there are, and no stage waits for a second frame. Without the relay (the cuda backend:
    its same-node edges carry device tensors only) the driver feeds each stage that reads them.
    Tokens equal the oracle's."""
    b = load_bundle(decode_bundle)
    plan = checked_plan(b, 3)
    topo, plain = build_topology(b, plan), build_topology(b, plan, relay=False)
    direct = {e.dst: e.entries for e in plain.outbound(DRIVER)}
    assert len(direct) >= 2 and topo.slot_entry in direct[2] and topo.step_entry in direct[2]
    assert [e.dst for e in topo.outbound(DRIVER)] == [0]
    edges = {(e.src, e.dst): e.entries for e in topo.edges}
    for j in (1, 2):
        assert set(direct.get(j, ())) <= set(edges[(j - 1, j)]) and set(topo.relayed[j]) <= set(edges[(j - 1, j)])
    assert set(direct[0]) | set(direct.get(1, ())) | set(direct[2]) == set(edges[(DRIVER, 0)])
    with Pipeline(decode_bundle, 3, launcher="process", slots=3) as pipe:
        res = Generator(pipe).generate_all(PROMPTS, NEW, in_flight=3)
        rec, steps = pipe.record(), pipe.submitted
    assert [r.tokens for r in res] == [oracle[i][0] for i in range(len(PROMPTS))]
    assert {dst for dst, n in rec.driver_frames_out.items() if n} == {0} and rec.driver_frames_out[0] >= steps


def test_a_pipeline_without_logits_sends_the_driver_tokens_only(decode_bundle, oracle):
    """`tvmpipe generate` streams tokens only and builds its pipeline with logits=False: the sampling
    stage's frame to the driver carries the drawn token alone, not a vocabulary of floats a token.
    Tokens equal the oracle's; asking such a pipeline for the logits is a one-line error."""
    b = load_bundle(decode_bundle)
    logits_bytes = b.graph.entries[b.graph.head_entries[b.generation.logits]].nbytes
    per_frame = {}
    for logits in (True, False):
        with Pipeline(decode_bundle, 2, launcher="process", slots=3, logits=logits, scores=False) as pipe:
            edges = {(e.src, e.dst): e.entries for e in pipe.topology.edges}
            assert (edges[(1, DRIVER)] == (pipe.topology.token_entry,)) is not logits
            res = Generator(pipe).generate_all(PROMPTS, NEW, in_flight=3)
            w = pipe.record().worker_stats[1]
            per_frame[logits] = w.bytes_out[DRIVER] / w.frames_out[DRIVER]
            if not logits:
                with pytest.raises(TvmpipeError, match="built with logits=False"):
                    list(Generator(pipe).generate(PROMPTS[:1], 2, logits_log={}))
        assert [r.tokens for r in res] == [oracle[i][0] for i in range(len(PROMPTS))]
    assert per_frame[True] - per_frame[False] >= logits_bytes, per_frame


def test_relay_keeps_tensors_and_stages_off_the_chain_on_the_driver():
    """Only a few bytes are passed on (RELAY_MAX_BYTES), and only to a stage that already takes a
    frame a micro-batch from the stage before it; anything else the driver sends itself."""
    from tvmpipe.executor.program import EntrySpec

    specs = {1: EntrySpec((2,), "int64"), 2: EntrySpec((1024,), "float32")}
    fed = [(1,), (1,), (1, 2), (1,)]
    recv = [{}, {0: [7]}, {1: [8]}, {0: [9]}]  # stage 3 takes nothing from stage 2
    carry, through = relay_inputs(fed, recv, specs)
    assert through == [False, True, False, False]
    assert carry == [(1,), (1,), (1, 2), (1,)]
    carry, through = relay_inputs([(1,), (), (1,), (1,)], [{}, {0: [7]}, {1: [8]}, {2: [9]}], specs)
    assert through == [False, True, True, True] and carry == [(1,), (1,), (1,), (1,)]


def test_a_killed_stage_without_state_keeps_every_cache(decode_bundle, oracle):
    """Stage 1 of 3 holds no state pair: killed mid-generation it is restarted and the pipeline
    replays what was incomplete without any sequence rebuilding its caches. Steps whose fed-back
    token came from a micro-batch that had completed get it from the driver instead; the others
    take it again from the sampling stage. The streams equal the oracle's."""
    with Pipeline(decode_bundle, 3, launcher="process", slots=3, timeouts=Timeouts(progress=20)) as pipe:
        assert 1 not in pipe.topology.stateful
        results = {}
        for n, _ in enumerate(Generator(pipe).generate(PROMPTS, NEW, results=results, in_flight=3)):
            if n == 8:
                pipe.launcher.kill(1)
        assert pipe.restarts[1] == 1 and pipe.state_losses == 0
    assert [results[i].tokens for i in range(len(PROMPTS))] == [oracle[i][0] for i in range(len(PROMPTS))]
    assert sum(r.replays for r in results.values()) == 0


def test_a_plain_run_of_a_decode_step_draws_nothing(decode_bundle, oracle):
    """Pipeline.run on a decode-step bundle, without a step tag: the driver's token is used, nothing
    is drawn or fed back, and the logits are those of the single-process loop."""
    prompt = PROMPTS[0]
    with Pipeline(decode_bundle, 2, launcher="process", slots=1) as pipe:
        b = pipe.bundle
        spec = pipe.topology.specs[pipe.topology.inputs[b.generation.token]]
        for p, t in enumerate(prompt):
            pipe.submit({b.generation.token: np.full(spec.shape, t, dtype=spec.dtype),
                         b.generation.position: np.full(pipe.topology.specs[pipe.topology.inputs[b.generation.position]].shape, p,
                                                        dtype=pipe.topology.specs[pipe.topology.inputs[b.generation.position]].dtype),
                         "__slot__": np.array([0, int(p == 0)])})
        got = [pipe.receive() for _ in prompt]
        assert [r.seq for r in got] == list(range(len(prompt))) and all(r.drawn == [0] for r in got)
        outs = [r.outputs for r in got]
    ref = oracle[0][1]
    for pos, out in enumerate(outs):
        assert np.abs(out[b.generation.logits] - ref[pos]).max() <= 1e-4 * np.abs(ref[pos]).max()


def test_a_fault_delivers_what_was_incomplete_lost_and_keeps_no_draws(decode_bundle):
    """replay="none" (a decode step's default): at a fault every incomplete micro-batch completes
    lost, the one whose own step raised with its error (`_cut_off`); a step submitted afterwards
    that would take the draws of a lost one takes the driver's placeholder instead, feeds nothing
    forward and is delivered lost too (`_unfeed_lost`), and so is a step that takes its draws in
    turn. The driver keeps no draws: a delivered step's are gone from it."""
    import threading

    b = load_bundle(decode_bundle)
    topo = build_topology(b, checked_plan(b, 2))
    pipe = object.__new__(Pipeline)  # the bookkeeping only: no workers
    pipe.topology, pipe.bundle, pipe.window, pipe.replay = topo, b, 4, "none"
    pipe._cond, pipe._listener = threading.Condition(), type("L", (), {"wake": lambda self: None})()
    pipe._completed, pipe._submitted, pipe._delivered = 5, 8, 5
    pipe._lost, pipe._lost_seqs, pipe._doomed, pipe.done_times = {}, set(), set(), {}
    pipe._inputs = {n: {} for n in range(5, 8)}
    pipe._failed_steps = {6: "micro-batch 6: ValueError: boom"}
    with pipe._cond:
        pipe._cut_off()
    assert pipe._completed == 8 and pipe._lost == {5: None, 6: "micro-batch 6: ValueError: boom", 7: None}
    assert pipe._inputs == {}
    tok, step = topo.inputs[b.generation.token], topo.step_entry
    blank = np.zeros(topo.specs[tok].shape, dtype=topo.specs[tok].dtype)
    fed = pipe._unfeed_lost(8, {tok: blank, step: encode_step(7, True, row_ints(0, 1, True, NO_SAMPLING))})
    assert fed[step][FROM] == -1 and not fed[step][FEED_NEXT] and 8 in pipe._doomed and 8 in pipe._lost_seqs
    again = pipe._unfeed_lost(9, {tok: blank, step: encode_step(8, True, row_ints(0, 2, True, NO_SAMPLING))})
    assert again[step][FROM] == -1 and 9 in pipe._doomed  # it took the draws of a lost one: lost in turn
    kept = {tok: blank, step: encode_step(4, True, row_ints(0, 2, True, NO_SAMPLING))}
    assert pipe._unfeed_lost(10, kept) is kept and 10 not in pipe._doomed  # micro-batch 4 completed


def test_the_token_stage_keeps_only_the_fed_back_tokens_a_step_can_take():
    """A step takes a token drawn at most `queue_depth` micro-batches before it: older fed-back
    tokens are dropped once they pile up, and a producer that sends more than twice that many ahead
    of the stage is refused (a FrameError closes its connection) instead of growing memory."""
    from tvmpipe.cluster.wire.frames import FrameError
    from tvmpipe.cluster.worker import StageWorker, Wiring

    w = object.__new__(StageWorker)  # the bookkeeping only
    w._wiring = Wiring("r", 0, 0, {}, [], queue_depth=5)
    w._next_seq = 40
    w._fed = {m: np.zeros(1, dtype=np.int64) for m in range(20, 31)}
    w._bound_fed(1)
    assert w._fed == {}  # 11 > 2 x 5, and all below 40 - 5: dropped
    w._fed = {m: np.zeros(1, dtype=np.int64) for m in range(36, 46)}  # 10: at the bound, kept
    w._bound_fed(1)
    assert sorted(w._fed) == list(range(36, 46))
    w._fed[46] = np.zeros(1, dtype=np.int64)
    with pytest.raises(FrameError, match="stage 1 sent 11 tokens ahead of micro-batch 40"):
        w._bound_fed(1)


@pytest.mark.ray
def test_generate_local_is_the_issue_command_on_ray_actors(decode_bundle, oracle):
    """The command-line contract as scripts run it, `tvmpipe generate BUNDLE --stages 2 --local
    --prompt-ids ... --json`: stage actors on its own embedded Ray (a separate process: this test
    session may hold one), the token fed back actor to actor, one JSON document, the oracle's tokens."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tvmpipe", "generate", str(decode_bundle), "--stages", "2", "--local",
                           "--prompt-ids", "5,17,3", "--prompt-ids", "60", "--max-new-tokens", str(NEW), "--json"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["stages"] == 2 and doc["error"] is None and doc["restarts"] == 0
    assert [s["prompt"] for s in doc["sequences"]] == [[5, 17, 3], [60]]
    assert [s["tokens"] for s in doc["sequences"]] == [oracle[0][0], oracle[1][0]]
    assert all(s["state_bytes"] > 0 for s in doc["metrics"]["stages"])  # reported by the stage actors


def test_a_token_read_in_two_stages_is_fed_by_the_driver(decode_bundle):
    """The token stage takes fed-back draws in place of the driver's placeholder, so it must hold
    every reader of the token input. When a later stage reads the token too (here a node of stage 1,
    edited in), no stage is the token stage: the topology has no feedback edge (the generation loop
    then submits no step before its token is known), while the last stage still draws and sends its
    token to the driver; stage and topology derive these roles from one function."""
    from tvmpipe.bundle.graph import EntryRef

    def generation_roles(b, s, e):
        return decode_layout(b).roles(b.graph, s, e)

    b = load_bundle(decode_bundle)
    plan = checked_plan(b, 2)
    token_in = build_topology(b, plan).inputs[b.generation.token]
    assert [generation_roles(b, s, e)[0] for s, e in plan.stages] == [token_in, None]
    late = next(n for n in range(*plan.stages[1]) if b.graph.nodes[n].is_op)
    b.graph.nodes[late].inputs.append(EntryRef(b.graph.entries[token_in].node))
    assert [generation_roles(b, s, e)[0] for s, e in plan.stages] == [None, None]
    topo = build_topology(b, plan)
    assert topo.feedback is None and topo.sampler == 1
    edges = {(e.src, e.dst): e.entries for e in topo.edges}
    assert (1, 0) not in edges and topo.token_entry in edges[(1, -1)]
    # the driver's token, to both: stage 1 takes it with stage 0's outputs (relay_inputs)
    assert token_in in edges[(-1, 0)] and token_in in edges[(0, 1)] and (-1, 1) not in edges


def test_forward_pass_commands_refuse_a_decode_step_in_one_line(decode_bundle, tmp_path, capsys):
    """run, sweep and the cluster job stream independent forward passes. A decode step fed to sweep
    or the job failed on its cache inputs ("unknown inputs 'k_cache_0', ...; missing input
    '__slot__'"), in words that never say why; all three now name the command and the one that runs it."""
    from tvmpipe.cli import main
    from tvmpipe.deploy.job import main as job_main

    for argv in (["run", str(decode_bundle), "--processes"],
                 ["sweep", str(decode_bundle), "--stages", "1..2", "--processes", "-o", str(tmp_path / "sweep")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"is a decode step with 4 state pair(s): tvmpipe {argv[0]} streams" in err, err
        assert "`tvmpipe generate`" in err
    run_dir = tmp_path / "job"
    assert job_main([str(decode_bundle), "--processes", "--run-dir", str(run_dir)]) == 1
    error = json.loads((run_dir / "error.json").read_text())
    assert error["phase"] == "plan" and "the cluster job streams forward passes" in error["message"]
    assert not (tmp_path / "sweep").exists()
