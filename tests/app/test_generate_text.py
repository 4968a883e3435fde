"""`tvmpipe generate` with text, run as a user runs it (issue 45, items 3-4): the bundle's own
tokenizer (or --tokenizer DIR) turns --prompt TEXT into ids and the tokens into text, one text prompt
streams to stdout, --chat renders the checkpoint's template, --stop TEXT and the checkpoint's eos ids
end a sequence, and --json keeps stdout to the document alone, a stage SIGKILLed under Ray included.

The model is the fixture decode step (vocabulary 64, context 16; tests/support/decode_bundle.py),
its tokenizer a word-level one over the same 64 words (tests/app/conftest.py), with transformers'
AutoTokenizer on the same directory as the oracle of ids and text and the single-process loop
(greedy_decode) as the oracle of tokens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.decode_bundle import write_tokenizer
from tests.support.generate_cli import chat_ids, generate, generate_json
from tests.support.pipeline_harness import cmdline, descendants
from tvmpipe.cli import main

NEW = 12  # new tokens: a 3-token prompt fills 15 of the 16 positions
PROMPT = "w5 world the"  # greedy from here draws 12 different words (no repeats to make stops ambiguous)


def test_text_prompts_round_trip_through_the_bundles_tokenizer(text_bundle, hf, greedy, capsys):
    """--prompt TEXT with the tokenizer the bundle carries: each sequence's prompt ids are the
    tokenizer's encoding, its tokens the single-process loop's, its text their decoding."""
    prompts = [PROMPT, "hello w10 w20"]
    doc = generate_json(capsys, text_bundle, "--stages", 2, "--processes", "--prompt", prompts[0],
                        "--prompt", prompts[1], "--max-new-tokens", NEW)
    assert [s["id"] for s in doc["sequences"]] == [0, 1]
    for text, s in zip(prompts, doc["sequences"]):
        assert s["prompt"] == hf.encode(text) == hf(text)["input_ids"]
        assert s["tokens"] == greedy(s["prompt"], NEW) and s["finish"] == "length"
        assert s["text"] == hf.decode(s["tokens"], skip_special_tokens=True)
        assert len(s["text"].split()) >= NEW - 2  # words, not an empty string that decodes the same


def test_one_text_prompt_streams_its_text_to_stdout(text_bundle, hf, greedy, monkeypatch):
    """Without --json, one text prompt is written to stdout a piece a token as the tokens arrive;
    the pieces join to the decoded text, then a newline and the run's summary."""

    class Recorder:
        def __init__(self):
            self.writes: list[str] = []

        def write(self, s: str) -> int:
            self.writes.append(s)
            return len(s)

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return False

    rec = Recorder()
    monkeypatch.setattr(sys, "stdout", rec)
    code = main(["generate", str(text_bundle), "--stages", "1", "--processes", "--prompt", PROMPT,
                 "--max-new-tokens", str(NEW)])
    monkeypatch.undo()
    assert code == 0
    tokens = greedy(hf.encode(PROMPT), NEW)
    pieces = rec.writes[:rec.writes.index("\n")]
    assert "".join(pieces) == hf.decode(tokens, skip_special_tokens=True)
    # one write a token, each the text that token adds (not the whole text at the end)
    assert pieces == [hf.decode(tokens[:i + 1])[len(hf.decode(tokens[:i])):] for i in range(len(tokens))]
    assert "tokens/s" in "".join(rec.writes[rec.writes.index("\n") + 1:])


def test_chat_prompts_render_the_checkpoints_template(text_bundle, hf, greedy, capsys, tmp_path):
    """--chat --system: each --prompt is a user message after the system message, rendered by the
    template in tokenizer_config.json: the prompt ids equal transformers' apply_chat_template. A
    tokenizer without a template, and --system without --chat, are one-line errors."""
    users, system, new = ["hello world", "w4"], "w9 w8", 8
    doc = generate_json(capsys, text_bundle, "--stages", 2, "--processes", "--chat", "--system", system,
                        "--prompt", users[0], "--prompt", users[1], "--max-new-tokens", new)
    for user, s in zip(users, doc["sequences"]):
        want = chat_ids(hf, [{"role": "system", "content": system}, {"role": "user", "content": user}])
        assert s["prompt"] == want and want[:3] == hf.encode("w1 w9 w8")  # the template's system turn
        assert s["tokens"] == greedy(want, new)
        assert s["text"] == hf.decode(s["tokens"], skip_special_tokens=True)

    plain = write_tokenizer(tmp_path / "plain")
    for argv, words in [(["--tokenizer", plain, "--chat", "--prompt", "hi"], "no chat template"),
                        (["--system", "w1", "--prompt", "hello"], "--system needs --chat"),
                        (["--chat", "--prompt-ids", "1"], "--chat needs --prompt")]:
        code, out, err = generate(capsys, text_bundle, "--processes", *argv)
        assert code == 2 and out == "" and words in err and err.count("\n") == 1, (argv, err)


def test_stop_strings_end_a_sequence_where_they_appear_and_never_show(text_bundle, hf, greedy, capsys):
    """--stop TEXT: a word from the middle of one unstopped text ends that sequence at the token
    that completes it, cut before it; a stop string spanning two tokens (the end of one word, the
    space, the start of the next) ends the other. `finish` is "stop" and no text holds a stop."""
    prompts = [PROMPT, "hello w57"]
    full = [greedy(hf.encode(p), NEW) for p in prompts]
    texts = [hf.decode(t, skip_special_tokens=True) for t in full]
    word = texts[0].split(" ")[4]
    words1 = texts[1].split(" ")
    at = len(" ".join(words1[:4]))  # the space before word 4
    span = texts[1][at - 1:at + 3]  # last character of word 3, the space, 2 of word 4
    stops = [word, span]

    def cut(tokens):
        """Where the stream must end: the first token whose text completes a stop string, the
        text cut before the earliest one."""
        for j in range(len(tokens)):
            text = hf.decode(tokens[:j + 1], skip_special_tokens=True)
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                return tokens[:j + 1], text[:min(hits)]
        raise AssertionError(f"no stop string in {hf.decode(tokens)!r}")

    want = [cut(t) for t in full]
    assert all(2 < len(w[0]) < NEW for w in want), want  # both cut in the middle, each by its own stop
    assert word in hf.decode(want[0][0]) and span in hf.decode(want[1][0]), want
    last, before = want[1][0][-1], hf.decode(want[1][0][:-1])
    assert span not in before and span not in hf.decode([last]) and span in hf.decode(want[1][0])  # two tokens'

    doc = generate_json(capsys, text_bundle, "--stages", 2, "--processes", "--prompt", prompts[0], "--prompt",
                        prompts[1], "--stop", stops[0], "--stop", stops[1], "--max-new-tokens", NEW)
    for (tokens, text), s in zip(want, doc["sequences"]):
        assert (s["tokens"], s["text"], s["finish"]) == (tokens, text, "stop")
        assert not any(stop in s["text"] for stop in stops)

    # The stop string completed by the last token --max-new-tokens allows: still cut, still "stop".
    n = len(want[0][0])
    doc = generate_json(capsys, text_bundle, "--stages", 1, "--processes", "--prompt", prompts[0], "--stop", word,
                        "--max-new-tokens", n)
    s = doc["sequences"][0]
    assert (s["tokens"], s["text"], s["finish"]) == (want[0][0], want[0][1], "stop")


def test_the_checkpoints_eos_id_ends_a_sequence_unless_ignored(decode_bundle, word_tokenizer, hf, greedy, capsys,
                                                              tmp_path):
    """generation_config.json's eos_token_id (with --tokenizer DIR, the bundle carrying none) ends
    a greedy sequence at that token: kept as its last token, not shown in the text. --ignore-eos
    runs on to --max-new-tokens, the word shown."""
    import shutil

    full = greedy(hf.encode(PROMPT), NEW)
    eos = full[4]
    k = full.index(eos)
    d = Path(shutil.copytree(word_tokenizer, tmp_path / "eos"))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))

    doc = generate_json(capsys, decode_bundle, "--stages", 2, "--processes", "--tokenizer", d, "--prompt", PROMPT,
                        "--max-new-tokens", NEW)
    s = doc["sequences"][0]
    assert (s["tokens"], s["finish"]) == (full[:k + 1], "stop") and 0 < k < NEW - 1
    assert s["text"] == hf.decode(full[:k]) and f"w{eos}" not in s["text"].split()

    doc = generate_json(capsys, decode_bundle, "--stages", 2, "--processes", "--tokenizer", d, "--prompt", PROMPT,
                        "--max-new-tokens", NEW, "--ignore-eos")
    s = doc["sequences"][0]
    assert (s["tokens"], s["finish"]) == (full, "length")
    assert s["text"] == hf.decode(full) and f"w{eos}" in s["text"].split()


def test_a_tokenizer_that_is_not_the_models_is_refused_in_one_line(decode_bundle, capsys, tmp_path):
    """--tokenizer DIR whose ids outrun the model's vocabulary of 64 (here 100 words), and a
    directory that is not there: one line each, before anything runs."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    big = Tokenizer(models.WordLevel({f"x{i}": i for i in range(100)}, unk_token="x0"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "big").mkdir()
    big.save(str(tmp_path / "big" / "tokenizer.json"))
    for where, words in [(tmp_path / "big", "more than the model's vocabulary of 64"),
                         (tmp_path / "none", "not a directory")]:
        code, out, err = generate(capsys, decode_bundle, "--processes", "--tokenizer", where, "--prompt", "x1")
        assert code == 2 and out == "" and words in err and err.count("\n") == 1, err


@pytest.mark.ray
@pytest.mark.slow
def test_json_is_all_of_stdout_when_a_stage_is_killed_under_ray(decode_bundle, greedy, tmp_path):
    """`tvmpipe generate ... --local --json` in a process of its own; once sequences have finished
    (the batch output file shows it), one stage actor is SIGKILLed. Ray prints "(raylet) A worker
    died or was killed ...": it goes to stderr, stdout holds the JSON document alone, the stage was
    restarted, and every sequence equals the single-process loop's (an unkilled run)."""
    distinct = [[i, 61, 63] for i in range(0, 60, 3)]  # 20 prompts, each 6 times: ~30 s of decoding
    prompts = distinct * 6
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    proc = subprocess.Popen([sys.executable, "-m", "tvmpipe", "generate", str(decode_bundle), "--stages", "2",
                             "--local", "--json", "--max-new-tokens", "13", "--prompts-file", str(src),
                             "--output", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed, deadline = None, time.time() + 240
    try:
        while proc.poll() is None and killed is None and time.time() < deadline:
            done = out.read_bytes().count(b"\n") if out.exists() else 0
            if done >= 8:
                actors = sorted(p for p in descendants(proc.pid) if cmdline(p).startswith("ray::StageActor"))
                assert len(actors) == 2, [cmdline(p) for p in descendants(proc.pid)]
                os.kill(actors[-1], signal.SIGKILL)
                killed = done
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=max(10.0, deadline - time.time()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert killed is not None and killed < len(prompts), "the run ended before a stage could be killed mid-way"
    assert proc.returncode == 0, stderr[-3000:]
    doc = json.loads(stdout)  # all of stdout: nothing before or after the document
    assert "A worker died or was killed" in stderr  # Ray's line, on stderr
    assert doc["restarts"] >= 1 and doc["error"] is None
    assert [s["prompt"] for s in doc["sequences"]] == prompts
    assert [s["tokens"] for s in doc["sequences"]] == [greedy(p, 13) for p in prompts]
