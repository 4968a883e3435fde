"""What the serve tests share: a tokenizer made with the `tokenizers` library that fits the zoo
GPT-2's 128-id vocabulary, `tvmpipe serve` run as a real child process (`python -m tvmpipe serve`)
on a free port, and readers for its server-sent events and /metrics."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tvmpipe.serve.metrics import parse

ROOT = Path(__file__).resolve().parents[2]
MODEL = "gpt2-step"  # the served name the tests give (--served-model-name)
API_KEY = "test-key-0123456789"
READY = re.compile(r"^tvmpipe serve: (\S+) on (http://\S+)/v1 ")

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello tokenizer.",
          "A pipeline of stages keeps its caches.", "What is the capital of France? Paris is."] * 8
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]  # ids 0..3; <|im_end|> (2) is the eos
EOS = 2
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


SLOWED = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "support" / "slowstage"),
                                         os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def slowed(seconds: float) -> dict[str, str]:
    """The environment of a server whose stages each sleep `seconds` a step (tests/support/slowstage):
    work that outlasts a bound on any machine, however fast."""
    return {**SLOWED, "TVMPIPE_TEST_STAGE_DELAY_S": str(seconds)}


def build_tokenizer(directory: Path, *, chat_template: bool = True, vocab: int = 120) -> Path:
    """A Metaspace BPE of `vocab` ids (the model's vocabulary is 128), ChatML special tokens, the
    eos in generation_config.json, and (optionally) a ChatML chat template."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                              "pad_token": "<|endoftext|>", "unk_token": "<unk>"}
    if chat_template:
        config["chat_template"] = CHATML
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    return directory


class ServerProcess:
    """`python -m tvmpipe serve BUNDLE --port 0 ARGS...` in a child process, up once it prints its
    ready line (its URL is read from it). `stderr` goes to a file (`log()`)."""

    def __init__(self, bundle: Path, *args: str, log_path: Path, env: dict[str, str] | None = None,
                 python_flags: tuple[str, ...] = (), timeout: float = 180.0, api_key: str | None = None):
        self.api_key = api_key
        self.log_path = log_path
        self._err = open(log_path, "w")
        cmd = [sys.executable, *python_flags, "-m", "tvmpipe", "serve", str(bundle), "--port", "0",
               "--served-model-name", MODEL, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._err, text=True, cwd=ROOT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._wait_ready(timeout)
        self.base = self.url + "/v1"

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.stdout.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.time() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                line = None
            if line is None:
                self.kill()
                raise RuntimeError(f"tvmpipe serve did not become ready:\n{self.log()[-4000:]}")
            m = READY.match(line)
            if m:
                return m.group(2)

    def log(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.log_path.read_text(errors="replace")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 120), **kw)

    def metrics(self) -> dict:
        r = httpx.get(self.url + "/metrics", headers=self.headers, timeout=30)
        r.raise_for_status()
        return parse(r.text)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90.0, group: bool = False) -> int:
        """Signal the server (with `group`, its whole process group, as Ctrl-C in a terminal does:
        it runs in a session of its own) and wait for it to exit; its exit status."""
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._err.close()


def metric(samples: dict, name: str, **labels: Any) -> float:
    """One sample of a parsed /metrics text (labels other than those given are ignored: the model)."""
    want = {(k, str(v)) for k, v in labels.items()}
    found = [v for (n, ls), v in samples.items() if n == name and want <= set(ls)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def stage_pids(samples: dict) -> dict[int, int]:
    """Stage -> the pid of its process now (tvmpipe_stage_info)."""
    out = {}
    for (name, labels), _ in samples.items():
        if name == "tvmpipe_stage_info":
            d = dict(labels)
            if d.get("pid"):
                out[int(d["stage"])] = int(d["pid"])
    return out


def sse_events(lines: list[str]) -> list[Any]:
    """The `data:` payloads of an SSE body's lines (JSON, or the string "[DONE]"), checking the
    framing: every event a `data: ` line followed by a blank line."""
    events = []
    for i, line in enumerate(lines):
        if not line:
            assert i > 0 and lines[i - 1].startswith("data: "), lines[max(0, i - 2):i + 1]
            continue
        assert line.startswith("data: "), line
        assert i + 1 < len(lines) and lines[i + 1] == "", lines[i:i + 2]
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def streamed_tokens(events: list[Any]) -> list[int]:
    """The token ids of a stream asked with return_token_ids."""
    return [t for e in events if isinstance(e, dict) for c in e.get("choices", []) for t in c.get("token_ids", [])]
