"""Generation pipelines of published decoders against transformers (issue 24, "Token-exact").

`tvmpipe compile NAME --decode` bundles of GPT-2, Llama and Qwen2 (tiny configs, seeded random
weights) run as K = 1, 2, 3 stateful stages in processes on the reference backend; Mistral, Qwen3,
Gemma, Phi-3, GPT-NeoX, OPT and Falcon as K = 2 in processes and K = 1, 3 with the stages in this
process; each with static caches and as a paged step
(`--kv paged`, the scheduler driving its page table). Every sequence's
tokens equal transformers' `generate(do_sample=False)` on the same weights, and every step's logits
are within 1e-4 x max|ref| of transformers' logits for the same prefix.

Static batches (`--batch 2` bundles of GPT-2 and Llama, two sequences per micro-batch, paged, the
default): each sequence's tokens and logits equal transformers' whatever row and group it runs in,
with queued prompts taking rows as they free (and, with static caches, for comparison, whole
groups), rows that stop early, and a stage killed mid-generation; seeded sampling gives the
streams of the batch-1 bundle.

Chunked prefill (`--chunk 4` bundles of GPT-2 and Llama, GPT-2 at batch 2 too): prompts go in up to
4 tokens a step; tokens and every step's logits (its last token's) are transformers', in fewer
micro-batches, on the strict fake CUDA driver too; seeded streams are the token-a-step bundle's,
with a stage killed mid-way as well.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tvm")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.tvm, pytest.mark.slow]

PROMPTS = [[5, 17, 3, 60, 9], [60], [1, 2, 3]]
NEW = 6


@pytest.fixture
def decoder(zoo_decoder):
    """conftest.py's session cache of compiled zoo decoders (max context 20, seed 1)."""
    return zoo_decoder


@pytest.mark.parametrize("kv", ["static", "paged"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "mistral", "qwen3", "gemma", "phi3", "gpt_neox", "opt",
                                  "falcon"])
def test_pipelined_generation_equals_transformers(decoder, name, kv):
    """Static caches, and a paged step (`--kv paged`, pages of 4 in the default pool: one row at
    the max context, so the two sequences in flight preempt each other) through the scheduler, at
    K = 1, 2 and 3: stage processes for GPT-2, Llama and Qwen2 and every family's K = 2; the other
    families' K = 1 and 3 with the stages in this process (tests/support/pipeline_harness.py
    ThreadLauncher: the same workers and wire, no process start-up)."""
    from tests.support.pipeline_harness import ThreadLauncher
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.compiler.decoders import transformers_generate, transformers_logits
    from tvmpipe.generation import Generator

    bundle, model = decoder(name, kv=kv)
    assert set(load_bundle(bundle).state_buffers.values()) == {1}  # its caches are updated in place
    want = [transformers_generate(model, p, NEW) for p in PROMPTS]
    assert any(len(set(w)) > 1 for w in want)  # not one repeated token: the check can fail
    refs = [transformers_logits(model, (p + w)[:-1]) for p, w in zip(PROMPTS, want)]  # [positions, vocab]
    for k in (1, 2, 3):
        launcher = "process" if name in ("gpt2", "llama", "qwen2") or k == 2 else ThreadLauncher()
        with Pipeline(bundle, k, launcher=launcher, slots=2, kv_tokens=None) as pipe:  # the compiled pool: preempts
            assert pipe.plan.num_stages == k
            results, logs = {}, {}
            list(Generator(pipe).generate(PROMPTS, NEW, results=results, logits_log=logs))
        for i in range(len(PROMPTS)):
            assert results[i].tokens == want[i], (name, k, i)
            for pos, got in logs[i].items():
                r = refs[i][pos]
                assert np.abs(np.asarray(got).reshape(-1)[-r.size:] - r).max() <= 1e-4 * np.abs(r).max(), (name, k, i, pos)


BATCH_PROMPTS = [[5, 17, 3, 60, 9], [60], [1, 2, 3], [7, 7], [9, 30, 2]]  # groups of 2: the last has an empty row
CHUNK_PROMPTS = [[5, 17, 3, 60, 9, 1, 2], [60], [1, 2, 3, 4], [7, 7, 8, 9, 10], [9, 30, 2]]  # chunks of 4: 2, 1, 1, 2, 1


def _until_stop(tokens: list[int], stop: int) -> list[int]:
    return tokens[:tokens.index(stop) + 1] if stop in tokens else tokens


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_static_batches_equal_transformers_per_sequence(decoder, name):
    """Five prompts of different lengths in groups of two rows, two groups in flight (the third
    waits for a slot), a stop token that ends some rows before their group: every sequence's tokens
    and every step's logits are transformers', at K = 1 and 2."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator
    from tvmpipe.compiler.decoders import transformers_generate, transformers_logits

    bundle, model = decoder(name, 2)
    assert load_bundle(bundle).graph.entries[0].shape[0] == 2  # the token input is [2, 1]
    full = [transformers_generate(model, p, NEW) for p in BATCH_PROMPTS]
    # a stop token that ends sequence 1 early while its row-mate, sequence 0, goes on
    stop = next(t for t in full[1][1:] if (full[0] + [t]).index(t) > full[1].index(t))
    want = [_until_stop(w, stop) for w in full]
    assert 1 < len(want[1]) < NEW and len(want[0]) > len(want[1]), want
    for k in (1, 2):
        with Pipeline(bundle, k, launcher="process", slots=2, kv_tokens=None) as pipe:  # the compiled pool
            assert pipe.topology.batch == 2
            results, logs = {}, {}
            events = list(Generator(pipe).generate(BATCH_PROMPTS, NEW, stop_tokens=[stop], results=results, logits_log=logs))
        assert [results[i].tokens for i in range(len(BATCH_PROMPTS))] == want, (name, k)
        assert [results[i].finish for i in range(2)] == ["length" if len(want[0]) == NEW else "stop", "stop"]
        for i in range(len(BATCH_PROMPTS)):  # each sequence's events in order
            assert [e.token for e in events if e.seq == i] == want[i]
        for i, p in enumerate(BATCH_PROMPTS):
            seq = p + want[i]
            ref = transformers_logits(model, seq[:-1])
            assert sorted(logs[i]) == list(range(len(seq) - 1))  # every step of the sequence, and no other
            for pos, got in logs[i].items():
                r = ref[pos]
                err = np.abs(np.asarray(got).reshape(-1)[-r.size:] - r).max()
                assert err <= 1e-4 * np.abs(r).max(), (name, k, i, pos)


def test_cli_generate_runs_a_static_batch_bundle(decoder, capsys):
    """`tvmpipe generate` on a batch-2 bundle: three prompts (two groups, the second with an empty
    row), transformers' tokens, the batch in the JSON document and in the summary line."""
    import json

    from tvmpipe.cli import main
    from tvmpipe.compiler.decoders import transformers_generate

    bundle, model = decoder("gpt2", 2)
    argv = ["generate", str(bundle), "--stages", "2", "--processes", "--max-new-tokens", "4",
            "--prompt-ids", "5,17,3", "--prompt-ids", "60", "--prompt-ids", "1,2"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["batch"] == 2 and doc["chunk"] == 1
    want = [transformers_generate(model, p, 4) for p in ([5, 17, 3], [60], [1, 2])]
    assert [s["tokens"] for s in doc["sequences"]] == want
    assert main(argv) == 0
    summary = next(line for line in capsys.readouterr().out.splitlines() if " tokens in " in line)
    assert summary.startswith("12 tokens in ") and ", 2 sequences a micro-batch, " in summary, summary


@pytest.mark.parametrize("batch,chunk", [(2, 1), (1, 4)])
def test_static_batches_and_chunked_steps_sample_the_batch_1_streams_and_survive_a_killed_stage(decoder, batch,
                                                                                                chunk):
    """Seeded sampling keys each draw by (seed, sequence, token index), not by row or step: a
    batch-2 bundle, and a --chunk 4 one (prompts 4 tokens a step), give each sequence the stream
    the batch-1, token-a-step bundle gives it; with stage 1 SIGKILLed mid-way, every group replays
    its rows (a chunk of its history a step) and the streams stay the same."""
    from tvmpipe.cluster.driver import Pipeline, Timeouts
    from tvmpipe.generation import Generator

    prompts = BATCH_PROMPTS if chunk == 1 else CHUNK_PROMPTS
    kw = dict(temperature=0.8, top_k=10, seed=3)
    one, _ = decoder("gpt2")
    other, _ = decoder("gpt2", batch, chunk)
    with Pipeline(one, 2, launcher="process", slots=2) as pipe:
        clean = [r.tokens for r in Generator(pipe).generate_all(prompts, NEW, **kw)]
    assert len({tuple(c) for c in clean}) == len(clean)
    with Pipeline(other, 2, launcher="process", slots=2, timeouts=Timeouts(progress=20)) as pipe:
        assert [r.tokens for r in Generator(pipe).generate_all(prompts, NEW, **kw)] == clean
        results = {}
        for n, _ in enumerate(Generator(pipe).generate(prompts, NEW, results=results, **kw)):
            if n == 7:
                pipe.launcher.kill(1)
        assert pipe.restarts == [0, 1] and pipe.state_losses == 1
    assert [results[i].tokens for i in range(len(prompts))] == clean
    assert sum(r.replays for r in results.values()) >= batch  # every row of a group in flight replayed


def test_static_batches_on_the_strict_fake_cuda_driver(decoder, tmp_path, monkeypatch):
    """The batch-2 GPT-2 step on cuda stages (fake driver, stages in this process, CUDA graphs, no
    logits to the driver, as `tvmpipe generate` runs it): transformers' tokens for every sequence,
    each slot's caches one device buffer per pair, and no rule of the driver broken."""
    from tests.support.fake_cuda import activate
    from tests.support.pipeline_harness import ThreadLauncher
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator
    from tvmpipe.compiler.decoders import transformers_generate

    bundle, model = decoder("gpt2", 2)
    activate(monkeypatch, tmp_path, [bundle])
    import pycuda.driver as drv

    launcher = ThreadLauncher()
    with Pipeline(bundle, 2, backend="cuda", backend_opts={"graphs": True}, launcher=launcher, slots=2,
                  max_restarts=0, logits=False) as pipe:
        res = Generator(pipe).generate_all(BATCH_PROMPTS, NEW)
        for st in (w.stage for w in launcher.workers if w is not None):
            if st.state is not None:
                assert {len(buf) for bufs in st.state.buffers.values() for buf in bufs} == {1}
    assert [r.tokens for r in res] == [transformers_generate(model, p, NEW) for p in BATCH_PROMPTS]
    assert not drv.violations


def test_a_queued_sequence_takes_a_finished_row_while_its_row_mate_runs_on(decoder):
    """One slot of two rows, five prompts: a short sequence finishes first and the next queued
    prompt takes its row while the long one goes on (its first token comes before the long one's
    last), in fewer micro-batches than admitting the rows together (18 steps and 24, wasted ones
    apart); the tokens and every step's
    logits are transformers' either way, at K = 1 and 2. Static caches (`--kv static`): the row's caches
    are reset alone in its slot (`topology.row_reset`; a paged row resets nothing)."""
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator
    from tvmpipe.compiler.decoders import transformers_generate, transformers_logits

    bundle, model = decoder("gpt2", 2, kv="static")
    prompts = [[5, 17, 3, 60, 9, 1, 2], [60], [1], [7], [8]]  # 12 steps for sequence 0, 6 for each other
    want = [transformers_generate(model, p, NEW) for p in prompts]
    for k in (1, 2):
        steps, order = {}, {}
        for per_row in (True, False):
            with Pipeline(bundle, k, launcher="process", slots=1) as pipe:
                assert pipe.topology.row_reset
                results, logs = {}, {}
                events = list(Generator(pipe).generate(prompts, NEW, results=results, logits_log=logs, row_admission=per_row))
                steps[per_row] = pipe.submitted
            assert [results[i].tokens for i in range(len(prompts))] == want, (k, per_row)
            for i, p in enumerate(prompts):
                ref = transformers_logits(model, (p + want[i])[:-1])
                assert sorted(logs[i]) == list(range(len(ref)))
                for pos, got in logs[i].items():
                    assert np.abs(np.asarray(got).reshape(-1) - ref[pos]).max() <= 1e-4 * np.abs(ref[pos]).max()
            seqs = [e.seq for e in events]
            order[per_row] = seqs.index(2) < len(seqs) - 1 - seqs[::-1].index(0)  # seq 2 starts before seq 0 ends
        assert order == {True: True, False: False}, (k, order)
        assert steps[True] < steps[False], (k, steps)


# ---- chunked prefill: prompts go in up to C tokens a step (--chunk C) -----------------------------

def _chunk_ends(n: int, chunk: int, new: int) -> list[int]:
    """Positions whose logits a sequence of an n-token prompt yields: each prompt chunk's last
    token, then every generated token's but the last."""
    return sorted({min(i + chunk, n) - 1 for i in range(0, n, chunk)} | set(range(n, n + new - 1)))


@pytest.mark.parametrize("kv", ["static", "paged"])
@pytest.mark.parametrize("name,batch", [("gpt2", 1), ("llama", 1), ("gpt2", 2)])
def test_chunked_prefill_equals_transformers(decoder, name, batch, kv):
    """A --chunk 4 decode step: each prompt goes in 4 tokens a step (its last chunk shorter), then
    one token a step, in the same graph; at K = 1 and 2 every sequence's tokens are transformers',
    the logits of every step (its last token's) within 1e-4 x max|ref|, and the prompts take fewer
    micro-batches than a token a step (batch 2: rows of different prompts side by side, taken as
    they free). Static caches, and a paged step (its tokens packed by q_indptr, the chunk kernel)."""
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator
    from tvmpipe.compiler.decoders import transformers_generate, transformers_logits

    bundle, model = decoder(name, batch, 4, kv=kv)
    one, _ = decoder(name, batch, kv=kv)
    want = [transformers_generate(model, p, NEW) for p in CHUNK_PROMPTS]
    with Pipeline(one, 2, launcher="process", slots=2) as pipe:
        Generator(pipe).generate_all(CHUNK_PROMPTS, NEW)
        unchunked = pipe.submitted
    for k in (1, 2):
        with Pipeline(bundle, k, launcher="process", slots=2, kv_tokens=None) as pipe:  # the compiled pool
            results, logs = {}, {}
            events = list(Generator(pipe).generate(CHUNK_PROMPTS, NEW, results=results, logits_log=logs))
            steps = pipe.submitted
        assert [results[i].tokens for i in range(len(CHUNK_PROMPTS))] == want, (name, batch, k)
        for i in range(len(CHUNK_PROMPTS)):
            assert [e.token for e in events if e.seq == i] == want[i]
        for i, p in enumerate(CHUNK_PROMPTS):
            ref = transformers_logits(model, (p + want[i])[:-1])
            assert sorted(logs[i]) == _chunk_ends(len(p), 4, NEW), (i, sorted(logs[i]))
            for pos, got in logs[i].items():
                assert np.abs(np.asarray(got).reshape(-1) - ref[pos]).max() <= 1e-4 * np.abs(ref[pos]).max()
        assert steps < unchunked, (k, steps, unchunked)


def test_cli_generate_runs_a_chunked_step(decoder, capsys):
    """`tvmpipe generate` on a --chunk 4 bundle: transformers' tokens, the chunk in the JSON
    document and in the summary line."""
    import json

    from tvmpipe.cli import main
    from tvmpipe.compiler.decoders import transformers_generate

    bundle, model = decoder("gpt2", 1, 4)
    argv = ["generate", str(bundle), "--stages", "2", "--processes", "--max-new-tokens", "4",
            "--prompt-ids", "5,17,3,60,9,1", "--prompt-ids", "60"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["batch"], doc["chunk"]) == (1, 4)
    assert [s["tokens"] for s in doc["sequences"]] == [transformers_generate(model, p, 4) for p in ([5, 17, 3, 60, 9, 1], [60])]
    assert main(argv) == 0
    summary = next(line for line in capsys.readouterr().out.splitlines() if " tokens in " in line)
    assert ", prompts 4 tokens a step, " in summary and "sequences a micro-batch" not in summary, summary


def test_chunked_prefill_on_the_strict_fake_cuda_driver(decoder, tmp_path, monkeypatch):
    """The --chunk 4, batch-2 GPT-2 step on cuda stages (fake driver, CUDA graphs, no logits to the
    driver): transformers' tokens, with fed-back draws merged into the first column of a row."""
    from tests.support.fake_cuda import activate
    from tests.support.pipeline_harness import ThreadLauncher
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator
    from tvmpipe.compiler.decoders import transformers_generate

    bundle, model = decoder("gpt2", 2, 4)
    activate(monkeypatch, tmp_path, [bundle])
    import pycuda.driver as drv

    with Pipeline(bundle, 2, backend="cuda", backend_opts={"graphs": True}, launcher=ThreadLauncher(), slots=2,
                  max_restarts=0, logits=False) as pipe:
        res = Generator(pipe).generate_all(CHUNK_PROMPTS, NEW)
    assert [r.tokens for r in res] == [transformers_generate(model, p, NEW) for p in CHUNK_PROMPTS]
    assert not drv.violations
