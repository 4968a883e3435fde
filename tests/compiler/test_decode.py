"""Decode-step bundles (compiler/decoders.py), lifted buffer mutations (compiler/lift.py) and the
single-process greedy loop (executor/decode_loop.py) against transformers' own generate().

Token-exact: for GPT-2, Llama, Qwen2, Qwen3, Gemma, Phi-3, GPT-NeoX, OPT and Falcon (tiny configs,
seeded random weights) the greedy loop over
GraphRunner on the reference backend yields the tokens of `generate(do_sample=False)`, and at every
step its logits are within 1e-4 x max|ref| of transformers' logits for the same prefix.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tvm")
pytest.importorskip("transformers")
pytestmark = pytest.mark.tvm

TOL = 1e-4
MAX_CONTEXT = 24
SEED = 1  # seed 0's GPT-2 and Llama repeat one token; seed 1 gives varied greedy streams
SEEDS = {"opt": 4}  # seed 1's OPT repeats one token after PROMPT


def seed_of(name: str) -> int:
    return SEEDS.get(name, SEED)
PROMPT = [5, 17, 3, 60, 9]
NEW = 12
DECODERS = ["gpt2", "llama", "qwen2", "qwen3", "gemma", "phi3", "gpt_neox", "opt", "falcon"]


def _export(source: str, **kw):
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    return export(source, progress=Progress(stream=None), **kw)


@pytest.fixture(scope="module")
def decode_bundle(tmp_path_factory):
    """decode_bundle(name, batch=1, kv=None): `tvmpipe compile NAME --decode` in the default
    layout (paged), or `--kv static`."""
    cache: dict[tuple[str, int, str | None], Path] = {}

    def get(name: str, batch: int = 1, kv: str | None = None) -> Path:
        if (name, batch, kv) not in cache:
            out = tmp_path_factory.mktemp(f"decode_{name}_{batch}_{kv}") / "b"
            if name == "gpt2":  # one of them through the command line, in process
                from tvmpipe.cli import main

                assert main(["compile", name, "--decode", "--max-context", str(MAX_CONTEXT), "--seed", str(SEED),
                             "--batch", str(batch), *(["--kv", kv] if kv else []), "-o", str(out)]) == 0
            else:
                _export(name, decode=MAX_CONTEXT, seed=seed_of(name), batch=batch, kv=kv).write(out)
            cache[name, batch, kv] = out
        return cache[name, batch, kv]

    return get


def _hf(name: str):
    from tvmpipe.compiler.decoders import build_decoder

    return build_decoder(name, seed_of(name))


def _hf_generate(model, prompt: list[int], new: int) -> list[int]:
    from tvmpipe.compiler.decoders import transformers_generate

    return transformers_generate(model, prompt, new)


def _hf_logits(model, seq: list[int]) -> np.ndarray:
    from tvmpipe.compiler.decoders import transformers_logits

    return transformers_logits(model, seq)


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_loop_is_token_exact_with_transformers(name, decode_bundle):
    from tvmpipe.executor.decode_loop import greedy_decode

    r = greedy_decode(decode_bundle(name), PROMPT, NEW)
    model = _hf(name)
    assert r.tokens[0] == _hf_generate(model, PROMPT, NEW)
    assert len(set(r.tokens[0])) > 1  # a stream that is not one repeated token
    ref = _hf_logits(model, r.sequences[0][:-1])  # one forward without a cache: logits of every prefix
    assert len(r.logits) == len(ref) == len(PROMPT) + NEW - 1
    for i, got in enumerate(r.logits):
        err = np.abs(got[0] - ref[i]).max()
        assert err <= TOL * np.abs(ref[i]).max(), f"{name} step {i}: {err}"


def test_batch_of_two_sequences_matches_each_alone(decode_bundle):
    """A static batch: each row is its own sequence, with its own cache rows and tokens."""
    from tvmpipe.executor.decode_loop import greedy_decode

    prompts = [PROMPT, [40, 2, 99, 7, 1]]
    r = greedy_decode(decode_bundle("llama", 2), prompts, 6)
    model = _hf("llama")
    assert r.tokens == [_hf_generate(model, p, 6) for p in prompts]


def test_decode_bundle_declares_its_caches_as_state(decode_bundle):
    """A `--kv static` step: per-layer K and V caches [B, H_kv, T, D] as slot state pairs, each
    updated in place; bundle.json records the layout."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.inspect import build_report, render_text

    b = load_bundle(decode_bundle("qwen2", kv="static"))
    assert b.name == "qwen2_decode" and b.manifest.source == {
        "kind": "decode", "name": "qwen2", "sha256": None, "seed": SEED,
        "decode": {"max_context": MAX_CONTEXT, "kv": {"layout": "static"}}}
    assert b.input_names[:2] == ["input_ids", "position"]
    assert [(p.name, p.input, p.output, p.fill) for p in b.state] == [
        ("layer0.k", "k_cache_0", 1, 0.0), ("layer0.v", "v_cache_0", 2, 0.0),
        ("layer1.k", "k_cache_1", 3, 0.0), ("layer1.v", "v_cache_1", 4, 0.0)]
    g = b.graph
    assert g.entry_of("k_cache_0").shape == (1, 2, MAX_CONTEXT, 16)  # GQA: 2 KV heads of 4, head dim 16
    gen = b.generation
    assert (gen.token, gen.position, gen.logits, gen.max_context, gen.vocab_size) == \
        ("input_ids", "position", 0, MAX_CONTEXT, 128)
    assert b.state_bytes_per_slot == 4 * 2 * MAX_CONTEXT * 16 * 4
    r = build_report(b)
    assert r["state_bytes_per_slot"] == b.state_bytes_per_slot and len(r["state"]) == 4
    assert r["state_resident_bytes_per_slot"] == b.state_bytes_per_slot  # each cache written in place
    assert r["state"][0] == {"name": "layer0.k", "input": "k_cache_0", "output": 1, "init": {"fill": 0.0},
                             "shape": [1, 2, MAX_CONTEXT, 16], "dtype": "float32", "bytes": 3072, "buffers": 1}
    assert r["generation"]["max_context"] == MAX_CONTEXT
    text = render_text(r)
    assert "state        4 pair(s) (4 x float32[1,2,24,16]), 12.0 KiB per sequence slot (batch 1)" in text
    assert "state held   12.0 KiB a slot in the stages: 4 pair(s) updated in place, 0 in two buffers" in text
    assert "max context 24, vocab 128" in text


def test_the_loop_refuses_bad_input_in_one_line(decode_bundle):
    from tvmpipe.executor.decode_loop import DecodeLoop, greedy_decode
    from tvmpipe.executor.errors import InputError

    b = decode_bundle("gpt2")
    with pytest.raises(InputError, match="outside the vocabulary"):
        greedy_decode(b, [5, 128], 2)
    with pytest.raises(InputError, match="max context is 24"):
        greedy_decode(b, list(range(20)), 8)
    loop = DecodeLoop(b)
    for i in range(MAX_CONTEXT):
        loop.step([i % 100])
    with pytest.raises(InputError, match="the sequence is full"):
        loop.step([1])


def test_mistral_decode_step_matches_transformers_in_torch():
    """Mistral's step (same code path as Llama) in torch eager, no TVM compile: fast coverage."""
    import torch

    from tvmpipe.compiler.decoders import build_decoder, decode_step_module

    model = build_decoder("mistral", SEED)
    step, spec = decode_step_module(model, 8)
    caches = [torch.zeros(spec.cache_shape) for _ in spec.caches]
    ref = _hf_logits(model, PROMPT)
    with torch.no_grad():
        for pos, tok in enumerate(PROMPT):
            out = step(torch.tensor([[tok]]), torch.tensor([pos]), *caches)
            caches = list(out[1:])
            np.testing.assert_allclose(out[0][0, 0].numpy(), ref[pos], atol=TOL * np.abs(ref[pos]).max())


def test_decode_refusals_are_one_line():
    from tvmpipe.compiler.decoders import build_decoder, decode_step_module
    from tvmpipe.compiler.errors import SourceError

    with pytest.raises(SourceError, match="'resnet50' is not a decoder"):
        build_decoder("resnet50")
    with pytest.raises(SourceError, match="sliding-window attention \\(8 tokens\\)"):
        decode_step_module(build_decoder("mistral", 0, sliding_window=8), 16)
    with pytest.raises(SourceError, match="exceeds the model's 256 learned positions"):
        decode_step_module(build_decoder("gpt2"), 300)
    with pytest.raises(SourceError, match="'t5_encoder' is not a decoder"):
        build_decoder("t5_encoder")
    with pytest.raises(SourceError, match="^FalconForCausalLM: the decode step covers multi-query, rotary"):
        decode_step_module(build_decoder("falcon", 0, alibi=True), 16)
    with pytest.raises(SourceError, match="^BertForMaskedLM: no decode step for this architecture .*falcon"):
        import transformers

        decode_step_module(transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)), 8)


def test_cli_max_context_needs_decode(capsys):
    from tvmpipe.cli import main

    assert main(["compile", "mlp", "-o", "/nonexistent/x", "--max-context", "8"]) != 0
    assert "--max-context needs --decode" in capsys.readouterr().err


# ---- a user's program with buffers updated in place ---------------------------------------------

def _cache_module(init=None):
    import torch

    class CacheModel(torch.nn.Module):
        """Two layers, each keeps a [1, T, D] cache in a registered buffer updated with copy_."""

        def __init__(self, t: int = 8, d: int = 4) -> None:
            super().__init__()
            self.proj = torch.nn.ModuleList([torch.nn.Linear(d, d) for _ in range(2)])
            for i in range(2):
                self.register_buffer(f"cache{i}", torch.zeros(1, t, d) if init is None else init(t, d))

        def forward(self, x, pos):
            at = (torch.arange(self.cache0.shape[1]) == pos)[None, :, None]
            h = x
            for i, p in enumerate(self.proj):
                buf = getattr(self, f"cache{i}")
                buf.copy_(torch.where(at, p(h)[:, None, :], buf))
                h = h + buf.sum(1)
            return h

    torch.manual_seed(0)
    return CacheModel().eval()


def _pt2(module, path: Path) -> Path:
    import torch

    torch.export.save(torch.export.export(module, (torch.zeros(1, 4), torch.tensor(0))), str(path))
    return path


def test_mutated_buffers_are_lifted_into_state_pairs(tmp_path):
    """Without lifting this compiled to frozen zero caches: outputs wrong from the second step on."""
    import copy

    import torch

    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor import GraphRunner

    module = _cache_module(lambda t, d: torch.full((1, t, d), 0.5))
    eager = copy.deepcopy(module)
    b = load_bundle(_export(str(_pt2(module, tmp_path / "c.pt2"))).write(tmp_path / "b"))
    assert b.input_names == ["x", "pos", "b_cache0", "b_cache1"]
    assert [(p.name, p.input, p.output, p.fill) for p in b.state] == [("cache0", "b_cache0", 1, 0.5),
                                                                        ("cache1", "b_cache1", 2, 0.5)]
    assert b.generation is None and b.state_bytes_per_slot == 2 * 8 * 4 * 4
    r = GraphRunner(b)
    state = {p.input: np.full(b.graph.entry_of(p.input).shape, p.fill, np.float32) for p in b.state}
    rng = np.random.default_rng(0)
    for t in range(5):
        x = rng.standard_normal((1, 4)).astype(np.float32)
        with torch.no_grad():
            ref = eager(torch.from_numpy(x), torch.tensor(t)).numpy()
        r.run(x=x, pos=np.array(t), **state)
        state = {p.input: r.get_output(p.output) for p in b.state}
        np.testing.assert_allclose(r.get_output(0), ref, atol=1e-5)
        np.testing.assert_allclose(state["b_cache1"], eager.cache1.numpy(), atol=1e-5)


def test_mutated_buffers_without_one_fill_value_are_refused(tmp_path):
    import torch

    from tvmpipe.compiler.errors import SourceError

    module = _cache_module(lambda t, d: torch.arange(t * d, dtype=torch.float32).reshape(1, t, d))
    with pytest.raises(SourceError, match=r"updates buffer\(s\) cache0, cache1 in place, and their initial values "
                                          "are not one constant") as exc:
        _export(str(_pt2(module, tmp_path / "c.pt2")))
    assert "\n" not in str(exc.value)


def test_in_place_update_of_an_input_is_refused(tmp_path):
    import torch

    from tvmpipe.compiler.errors import SourceError

    class AddInPlace(torch.nn.Module):
        def forward(self, x, y):
            y.add_(x)
            return x * 2

    path = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(AddInPlace(), (torch.zeros(2), torch.zeros(2))), str(path))
    with pytest.raises(SourceError, match="updates its input\\(s\\) y in place"):
        _export(str(path))


def test_a_prompt_holding_the_pad_token_id_is_not_masked_by_the_oracle(decode_bundle):
    """transformers' generate takes every pad_token_id in an unmasked prompt for padding: the
    oracle passes an explicit mask, so a prompt with token 0 is generated from whole (found by
    bench/generate.py: seed 1's Llama on [102, 0, 126, 85] gave 98 where its own logits say 68)."""
    from tvmpipe.executor.decode_loop import greedy_decode

    prompt = [102, 0, 126, 85]
    model = _hf("llama")
    want = _hf_generate(model, prompt, 4)
    assert want[0] == int(np.argmax(_hf_logits(model, prompt)[-1]))  # generate agrees with the plain forward
    assert greedy_decode(decode_bundle("llama"), prompt, 4).tokens[0] == want


# ---- chunked prefill: a step of up to C tokens a row (--chunk C) ----------------------------------

@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "mistral", "qwen3", "gemma", "phi3", "gpt_neox", "opt",
                                  "falcon"])
def test_chunked_steps_match_transformers_in_torch(name):
    """Every zoo decoder's step at --chunk 3, batch 2, in torch eager: two prompts of different
    lengths go in 3 tokens a row a step (the last chunk of each shorter, `count` saying how many),
    then one token a step; after each step the row's logits are transformers' for the prefix
    ending at its last real token, and padding rows past a finished prompt change nothing."""
    import torch

    from tvmpipe.compiler.decoders import build_decoder, decode_step_module, example_inputs

    model = build_decoder(name, seed_of(name))
    step, spec = decode_step_module(model, 16, batch=2, chunk=3)
    ex = example_inputs(spec)
    assert ex["input_ids"].shape == (2, 3) and spec.inputs[:3] == ["input_ids", "position", "count"]
    caches = [torch.from_numpy(ex[n]) for n in spec.caches]
    seqs = [PROMPT + [8, 1, 44], [60, 2]]  # 8 and 2 tokens: chunks of 3, 3, 2 and of 2
    ref = [_hf_logits(model, s) for s in seqs]
    pos, checked = [0, 0], 0
    with torch.no_grad():
        while any(p < len(s) for p, s in zip(pos, seqs)):
            ids, count = np.zeros((2, 3), np.int64), []
            for r, s in enumerate(seqs):
                part = s[pos[r]:pos[r] + 3]
                ids[r, :len(part)] = part
                count.append(max(len(part), 1))  # a finished row: one padding token at its next position
            out = step(torch.from_numpy(ids), torch.tensor(pos), torch.tensor(count), *caches)
            caches = list(out[1:])
            for r, s in enumerate(seqs):
                if pos[r] < len(s):
                    last = pos[r] + count[r] - 1
                    np.testing.assert_allclose(out[0][r, 0].numpy(), ref[r][last], atol=TOL * np.abs(ref[r][last]).max())
                    checked += 1
                    pos[r] += count[r]
    assert checked == 4  # 3 chunks of the long prompt, 1 of the short


def test_chunked_greedy_loop_is_token_exact_with_transformers(zoo_decoder):
    """The compiled --chunk 4 GPT-2 step in one GraphRunner: a 7-token prompt in two steps (4, 3),
    then a token a step; transformers' tokens, and each step's logits are its last token's."""
    from tvmpipe.compiler.decoders import transformers_generate, transformers_logits
    from tvmpipe.executor.decode_loop import DecodeLoop, greedy_decode
    from tvmpipe.executor.errors import InputError

    bundle, model = zoo_decoder("gpt2", 1, 4)
    prompt = PROMPT + [1, 2]
    r = greedy_decode(bundle, prompt, 6)
    assert r.tokens[0] == transformers_generate(model, prompt, 6)
    ref = transformers_logits(model, prompt + r.tokens[0][:-1])
    assert len(r.logits) == 2 + 5
    for got, pos in zip(r.logits, [3, 6, 7, 8, 9, 10, 11]):
        np.testing.assert_allclose(got[0], ref[pos], atol=TOL * np.abs(ref[pos]).max())
    loop = DecodeLoop(bundle)
    assert loop.chunk == 4
    with pytest.raises(InputError, match="^5 token\\(s\\) a row in one step; this step takes 1 to 4 "):
        loop.step([[1, 2, 3, 4, 5]])


def test_chunk_refusals_are_one_line(capsys):
    from tvmpipe.cli import main
    from tvmpipe.compiler.decoders import build_decoder, decode_step_module
    from tvmpipe.compiler.errors import SourceError

    model = build_decoder("gpt2")
    for bad in (0, 9, True):
        with pytest.raises(SourceError, match="^--chunk must be an integer from 1 to the max context 8, got"):
            decode_step_module(model, 8, chunk=bad)
    assert main(["compile", "gpt2", "-o", "/nonexistent/x", "--chunk", "4"]) != 0
    assert "--chunk needs --decode" in capsys.readouterr().err
