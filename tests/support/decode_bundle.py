"""A tiny GPT-style decode step with explicit KV caches, compiled into a version-2 bundle with
declared state pairs and a generation section: the fixture of the generation tests and bench.

Inputs: `token` [1, 1] int64, `position` [1] int64, then per layer `k{i}`, `v{i}` [1, H, T, D]
float32. Outputs (heads): 0 logits [1, 1, V], then per layer the updated k{i}, v{i}. The cache
update is the form that compiles (issue 24): `torch.where(arange(T) == pos, new, cache)`.

`decode_bundle(dir)` compiles once per directory (the result is cached on disk under `dir`);
`torch_greedy(...)` is the same model's own greedy loop in torch eager, for cross-checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB, DIM, HEADS, HEAD_DIM, LAYERS, CONTEXT = 64, 32, 2, 16, 2, 16


def torch_module(seed: int = 0, layers: int = LAYERS):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(DIM)
            self.qkv = nn.Linear(DIM, 3 * DIM)
            self.proj = nn.Linear(DIM, DIM)
            self.ln2 = nn.LayerNorm(DIM)
            self.fc1 = nn.Linear(DIM, 2 * DIM)
            self.fc2 = nn.Linear(2 * DIM, DIM)

        def forward(self, x, pos, k_cache, v_cache):
            b = x.shape[0]
            q, k, v = self.qkv(self.ln1(x)).split(DIM, dim=-1)
            q = q.reshape(b, 1, HEADS, HEAD_DIM).permute(0, 2, 1, 3)
            k = k.reshape(b, 1, HEADS, HEAD_DIM).permute(0, 2, 1, 3)
            v = v.reshape(b, 1, HEADS, HEAD_DIM).permute(0, 2, 1, 3)
            slots = torch.arange(CONTEXT).reshape(1, 1, CONTEXT, 1)
            here = slots == pos.reshape(1, 1, 1, 1)
            k_new = torch.where(here, k, k_cache)
            v_new = torch.where(here, v, v_cache)
            att = torch.matmul(q, k_new.transpose(-1, -2)) * (HEAD_DIM ** -0.5)
            seen = torch.arange(CONTEXT).reshape(1, 1, 1, CONTEXT) <= pos.reshape(1, 1, 1, 1)
            att = torch.where(seen, att, torch.full_like(att, -1e9))
            y = torch.matmul(torch.softmax(att, dim=-1), v_new)
            y = y.permute(0, 2, 1, 3).reshape(b, 1, DIM)
            x = x + self.proj(y)
            x = x + self.fc2(torch.relu(self.fc1(self.ln2(x))))
            return x, k_new, v_new

    class DecodeStep(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, DIM)
            self.wpe = nn.Embedding(CONTEXT, DIM)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.ln_f = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, token, position, *caches):
            x = self.wte(token) + self.wpe(position).reshape(1, 1, DIM)
            new = []
            for i, blk in enumerate(self.blocks):
                x, k, v = blk(x, position, caches[2 * i], caches[2 * i + 1])
                new += [k, v]
            return (self.head(self.ln_f(x)), *new)

    torch.manual_seed(seed)
    m = DecodeStep().eval()
    with torch.no_grad():  # larger weights than the default init: logits that differ clearly
        for p in m.parameters():
            p.mul_(3.0)
    return m


def example_args(layers: int = LAYERS):
    import torch

    return (torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
            *[torch.zeros(1, HEADS, CONTEXT, HEAD_DIM) for _ in range(2 * layers)])


def decode_bundle(out_dir: str | Path, layers: int = LAYERS, seed: int = 0) -> Path:
    """Compile the decode step into `out_dir`/bundle (once: an existing bundle is reused)."""
    import torch

    from tvmpipe.bundle import load_bundle, write_bundle
    from tvmpipe.bundle.state import GenerationSpec, StatePair
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    out_dir = Path(out_dir)
    final = out_dir / "bundle"
    if (final / "bundle.json").exists():
        return final
    out_dir.mkdir(parents=True, exist_ok=True)
    m = torch_module(seed, layers)
    ep = torch.export.export(m, example_args(layers))
    pt2 = out_dir / "decode.pt2"
    torch.export.save(ep, str(pt2))
    ex = export(str(pt2), progress=Progress(stream=None), name="tiny-decode")
    raw = ex.write(out_dir / "raw", overwrite=True)
    b = load_bundle(raw)
    names = list(b.input_names)
    # the importer names inputs after the program's placeholders: token, position, then the caches
    token, position, caches = names[0], names[1], names[2:]
    assert len(caches) == 2 * layers and len(b.graph.heads) == 1 + 2 * layers, (names, len(b.graph.heads))
    state = [StatePair(f"{'kv'[j % 2]}{j // 2}", caches[j], 1 + j, 0.0) for j in range(2 * layers)]
    gen = GenerationSpec(token, position, 0, CONTEXT, VOCAB)
    write_bundle(final, model="tiny-decode", source=ex.source, target=ex.target, batch=1, dtype=ex.dtype,
                 graph=ex.graph, kernels=ex.kernels, ops=ex.ops, cuda_source=ex.cuda_source, inputs=ex.inputs,
                 params=ex.params, tvm_version=ex.tvm_version, state=state, generation=gen, overwrite=True)
    (out_dir / "inputs.json").write_text(json.dumps(names))
    return final


def torch_greedy(prompt: list[int], max_new: int, seed: int = 0, layers: int = LAYERS) -> tuple[list[int], list[np.ndarray]]:
    """The torch module's own greedy loop: (generated tokens, logits per step)."""
    import torch

    m = torch_module(seed, layers)
    caches = list(example_args(layers)[2:])
    toks, logits_seen, out = list(prompt), [], []
    pos = 0
    with torch.no_grad():
        while len(out) < max_new and pos < CONTEXT:
            res = m(torch.tensor([[toks[pos]]]), torch.tensor([pos]), *caches)
            caches = list(res[1:])
            logits_seen.append(res[0].numpy())
            if pos >= len(prompt) - 1:
                t = int(res[0][0, -1].argmax())
                out.append(t)
                toks.append(t)
            pos += 1
    return out, logits_seen


def runner_greedy(bundle, prompt: list[int], max_new: int) -> tuple[list[int], dict[int, np.ndarray]]:
    """The single-process oracle (tvmpipe.executor.decode_loop.greedy_decode: one GraphRunner feeding
    its caches itself) for one prompt: (tokens, logits by position)."""
    from tvmpipe.executor.decode_loop import greedy_decode

    r = greedy_decode(bundle, prompt, max_new)
    return r.tokens[0], dict(enumerate(r.logits))


def write_tokenizer(path) -> Path:
    """A local transformers tokenizer directory for the fixture's 64-token vocabulary (word level:
    w0..w59, hello, world, [UNK], the), written without any download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(60)] + ["hello", "world", "[UNK]", "the"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(str(path))
    return Path(path)


# A chat template in the fixture's words (w1: a system turn, w2: a user turn, w3: the assistant's),
# so that chat prompts tokenize inside the 64-token vocabulary.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}w1 {{ m['content'] }} "
                 "{% elif m['role'] == 'user' %}w2 {{ m['content'] }} {% else %}w3 {{ m['content'] }} {% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}w3{% endif %}")


def write_chat_tokenizer(path, template: str = CHAT_TEMPLATE) -> Path:
    """`write_tokenizer`'s directory with a chat template in tokenizer_config.json."""
    path = write_tokenizer(path)
    config = path / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": template}, indent=1))
    return path


def bundle_with_tokenizer(bundle, tokenizer, out) -> Path:
    """A copy of `bundle` at `out` carrying `tokenizer`'s files in its tokenizer/ directory, as
    `tvmpipe compile DIR` writes a checkpoint's (bundle.json names the directory and checksums it)."""
    import hashlib
    import shutil

    from tests.support.bundle_edits import edit_json

    out = Path(out)
    shutil.copytree(bundle, out)
    (out / "tokenizer").mkdir()
    sums = {}
    for f in sorted(Path(tokenizer).iterdir()):
        shutil.copyfile(f, out / "tokenizer" / f.name)
        sums[f"tokenizer/{f.name}"] = hashlib.sha256(f.read_bytes()).hexdigest()

    def name_it(manifest: dict) -> None:
        manifest["tokenizer"] = "tokenizer"
        manifest["files"].update(sums)

    edit_json(out, "bundle.json", name_it)
    return out
