"""Batch jobs, run as a user runs them (issue 45, item 5): `tvmpipe generate BUNDLE --prompts-file
in.jsonl --output out.jsonl` writes one whole line per prompt as its sequence finishes; a bad input
line is one error naming its line before anything runs; a rerun with the same output skips what is
there (a torn last line dropped); after a SIGKILLed driver and a rerun every prompt appears exactly
once, equal to an uninterrupted run (sampled: each prompt's draws are keyed by its line).

The bundle, tokenizer and oracles are tests/app/conftest.py's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.generate_cli import chat_ids, generate, generate_json
from tests.support.pipeline_harness import alive, descendants

NEW = 8
# One line of each kind, with and without "id"; a blank line (skipped, the numbering goes on).
LINES = [{"prompt": "w5 world the"},
         {"id": "chat", "messages": [{"role": "user", "content": "hello world"}]},
         {"prompt_ids": [60, 57]},
         None,
         {"id": 7, "prompt": "hello w10 w20"},
         {"messages": [{"role": "system", "content": "w9"}, {"role": "user", "content": "w4"}]},
         {"id": "ids", "prompt_ids": [10]}]
IDS = [1, "chat", 3, 7, 6, "ids"]  # a line's id, else its line number
SAMPLED = ["--temperature", "0.9", "--top-k", "20", "--seed", "7"]


def write_lines(path: Path, lines) -> Path:
    path.write_text("".join(("" if x is None else x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_output(path: Path) -> list[dict]:
    data = path.read_text()
    assert data.endswith("\n")
    return [json.loads(line) for line in data.splitlines()]


def prompt_of(hf, line: dict) -> list[int]:
    if "prompt_ids" in line:
        return line["prompt_ids"]
    return hf.encode(line["prompt"]) if "prompt" in line else chat_ids(hf, line["messages"])


def job_args(src: Path, out: Path, *more) -> list[str]:
    return ["--stages", "2", "--processes", "--prompts-file", str(src), "--output", str(out),
            "--max-new-tokens", str(NEW), *map(str, more)]


@pytest.fixture(scope="module")
def sampled_file(tmp_path_factory) -> Path:
    """40 prompts of every kind (the LINES repeated with fresh ids), for the sampled and killed jobs."""
    d = tmp_path_factory.mktemp("sampled")
    lines = [{**x, "id": f"{n}-{x.get('id', i)}"} for n in range(7) for i, x in enumerate(LINES) if x is not None]
    return write_lines(d / "in.jsonl", lines[:40])


@pytest.fixture(scope="module")
def uninterrupted(text_bundle, sampled_file, tmp_path_factory) -> dict:
    """The sampled job run once, start to end: its lines by id."""
    from tvmpipe.cli import main

    out = tmp_path_factory.mktemp("whole") / "out.jsonl"
    assert main(["generate", str(text_bundle), *job_args(sampled_file, out, *SAMPLED)]) == 0
    lines = read_output(out)
    by_id = {x["id"]: x for x in lines}
    assert len(by_id) == len(lines) == 40
    return by_id


def test_a_job_writes_one_whole_line_per_prompt(text_bundle, hf, greedy, capsys, tmp_path, monkeypatch):
    """Every kind of line, with and without an id: one output line each with its id, its prompt
    ids as the tokenizer (or chat template) makes them, the single-process loop's tokens and their
    text; nothing on stdout, a progress line on stderr (its clock started once the stages are up,
    before the first sequence ends). A line equals a one-prompt run of the same prompt (here the
    chat with a system message, run as --chat --system --prompt)."""
    from tvmpipe.app.progressbar import ProgressBar

    calls = []
    for name in ("begin", "update"):
        monkeypatch.setattr(ProgressBar, name, lambda self, *a, f=getattr(ProgressBar, name), n=name:
                            (calls.append(n), f(self, *a))[1])
    src, out = write_lines(tmp_path / "in.jsonl", LINES), tmp_path / "out.jsonl"
    code, stdout, stderr = generate(capsys, text_bundle, *job_args(src, out))
    assert code == 0 and stdout == "", stderr[-3000:]
    assert "6/6 sequences" in stderr and f"6 sequence(s) written to {out}, 0 already there" in stderr
    assert calls == ["begin"] + ["update"] * 6
    lines = read_output(out)
    assert sorted(map(str, (x["id"] for x in lines))) == sorted(map(str, IDS))
    given = {i: x for i, x in zip(IDS, (x for x in LINES if x is not None))}
    for line in lines:
        prompt = prompt_of(hf, given[line["id"]])
        assert line["prompt"] == prompt
        assert line["tokens"] == greedy(prompt, NEW) and line["finish"] == "length"
        assert line["text"] == hf.decode(line["tokens"], skip_special_tokens=True)
        assert set(line) == {"id", "prompt", "tokens", "finish", "text"}

    one = generate_json(capsys, text_bundle, "--stages", 2, "--processes", "--chat", "--system", "w9", "--prompt",
                        "w4", "--max-new-tokens", NEW)["sequences"][0]
    line = next(x for x in lines if x["id"] == 6)
    assert {k: one[k] for k in ("prompt", "tokens", "text", "finish")} == {k: line[k] for k in
                                                                            ("prompt", "tokens", "text", "finish")}


BAD = [  # (lines after a good first one, the bad line's number, words of the error)
    (['{"prompt": "hello"'], 2, "not valid JSON"),
    ([[1, 2]], 2, "expected a JSON object"),
    ([{"prompt": "hello", "temperature": 1}], 2, "unknown key 'temperature'"),
    ([{"prompt": "hello", "prompt_ids": [1]}], 2, "exactly one of prompt, prompt_ids, messages"),
    ([{"id": 5}], 2, "exactly one of prompt, prompt_ids, messages"),
    ([{"id": [5], "prompt": "w1"}], 2, "id must be a string or an integer"),
    ([{"id": "a", "prompt": "w1"}, None, {"id": "a", "prompt": "w2"}], 4, "id 'a' appears twice"),
    ([{"prompt_ids": [1, 2]}, {"id": 2, "prompt": "w2"}], 3, "id 2 appears twice"),  # line 2's default id
    ([{"prompt_ids": [1, 64]}], 2, "token id 64 is outside the vocabulary 0..63"),
    ([{"prompt_ids": "1,2"}], 2, "prompt_ids must be a list"),
    ([{"prompt_ids": [1] * 17}], 2, "has 17 tokens, more than the bundle's max_context 16"),
    ([{"prompt": "w1 " * 17}], 2, "has 17 tokens, more than the bundle's max_context 16"),
    ([{"prompt": 5}], 2, "prompt must be a string"),
    ([{"messages": "hello"}], 2, "messages: expected a list"),
    ([{"messages": [{"role": "user"}]}], 2, "messages[0].content: missing"),
    # issue 50: lines json.loads cannot take, or that fail later, are the same one-line error
    (['{"prompt": ' + "[" * 2000 + "]" * 2000 + "}"], 2, "2001 levels deep, more than the limit of 64"),
    (['{"prompt_ids": [' + "9" * 5000 + "]}"], 2, "not valid JSON"),  # past Python's int-from-text limit
    (['{"prompt": "w1 \\ud800"}'], 2, "prompt: a string that cannot be encoded as UTF-8"),
    (['{"messages": [{"role": "user", "content": "\\udfff"}]}'], 2, "messages[0].content: a string that cannot"),
    (['{"\\ud800": 1}'], 2, "an object key that cannot be encoded as UTF-8"),
    ([{"prompt_ids": [1.5]}], 2, "token"),
    (['{"prompt_ids": [NaN]}'], 2, "token"),
    ([{"prompt_ids": [True]}], 2, "token"),
    ([{"prompt_ids": [10 ** 30]}], 2, "token"),
    ([{"messages": [{"role": 5, "content": "w1"}]}], 2, "messages[0].role"),
    ([{"messages": [{"role": "user", "content": {"a": [[[1]]]}}]}], 2, "messages[0].content"),
]


@pytest.mark.parametrize("lines,bad,words", BAD, ids=[b[2][:30] for b in BAD])
def test_a_bad_line_is_one_error_naming_it_before_anything_runs(text_bundle, capsys, tmp_path, monkeypatch,
                                                                lines, bad, words):
    """Every line is checked before any stage starts (GenerationRun.execute is never reached) and
    before the output is created: one line on stderr naming the file and line, exit 2."""
    from tvmpipe.app.generating import GenerationRun

    def never(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(GenerationRun, "execute", never)
    src, out = write_lines(tmp_path / "in.jsonl", [{"prompt": "hello"}, *lines]), tmp_path / "out.jsonl"
    code, stdout, stderr = generate(capsys, text_bundle, *job_args(src, out))
    assert code == 2 and stdout == "" and stderr.count("\n") == 1, stderr
    assert re.search(rf"{re.escape(str(src))} line {bad}\b", stderr) and words in stderr, stderr
    assert not out.exists()


def test_job_options_that_do_not_go_together_are_one_line_errors(text_bundle, capsys, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    together = "--prompts-file and --output go together"
    for argv, words in [(["--prompts-file", src], together),
                        (["--output", tmp_path / "o.jsonl", "--prompt", "w1"], together),
                        (["--prompts-file", src, "--output", tmp_path / "o.jsonl", "--prompt", "w1"],
                         "--prompts-file replaces --prompt"),
                        (["--prompts-file", src, "--output", tmp_path / "o.jsonl", "--chat"], "--chat is for --prompt"),
                        (["--prompts-file", tmp_path / "none.jsonl", "--output", tmp_path / "o.jsonl"],
                         "cannot read it"),
                        (["--prompts-file", write_lines(tmp_path / "empty.jsonl", [None]), "--output",
                          tmp_path / "o.jsonl"], "no prompts in it"),
                        (["--prompts-file", src, "--output", tmp_path / "no" / "o.jsonl"], "does not exist")]:
        code, stdout, stderr = generate(capsys, text_bundle, "--processes", *argv)
        assert code == 2 and stdout == "" and words in stderr and stderr.count("\n") == 1, (argv, stderr)


def test_a_rerun_skips_what_the_output_holds_and_drops_a_torn_line(text_bundle, sampled_file, uninterrupted,
                                                                  capsys, tmp_path):
    """The output already holds 4 whole lines and half of a fifth (a job killed mid-write): the
    rerun drops the torn half, leaves the 4 lines as they are, and generates the other 36, each
    equal to the uninterrupted job's line although they now run as a different set of sequences
    (sampled: each prompt's draws are keyed by its line, not by its place in the run)."""
    ref = list(uninterrupted.values())
    out = tmp_path / "out.jsonl"
    head = "".join(json.dumps(x) + "\n" for x in ref[:4])
    out.write_text(head + json.dumps(ref[4])[:25])
    code, stdout, stderr = generate(capsys, text_bundle, *job_args(sampled_file, out, *SAMPLED))
    assert code == 0 and stdout == "", stderr[-3000:]
    assert f"36 sequence(s) written to {out}, 4 already there" in stderr
    assert out.read_text().startswith(head)
    lines = read_output(out)
    assert len(lines) == 40 and {x["id"]: x for x in lines} == uninterrupted
    assert sum(x["tokens"] != ref[0]["tokens"] for x in ref if x["prompt"] == ref[0]["prompt"]) > 0  # sampled

    code, stdout, stderr = generate(capsys, text_bundle, *job_args(sampled_file, out, *SAMPLED))
    assert code == 0 and "0 sequence(s) written" in stderr and "40 already there" in stderr
    assert read_output(out) == lines  # all done: nothing runs, nothing is added


@pytest.mark.slow
def test_a_job_through_a_driver_sigkill_and_a_rerun_equals_an_uninterrupted_one(text_bundle, sampled_file,
                                                                                uninterrupted, tmp_path):
    """The job in a process of its own (stage processes as its children), SIGKILLed once the output
    has some lines but not all: its stage processes go with it; the same command again completes
    the file, in which every prompt appears exactly once, equal to the uninterrupted job's line."""
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "tvmpipe", "generate", str(text_bundle), *job_args(sampled_file, out, *SAMPLED)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed, stages, deadline = None, set(), time.time() + 180
    try:
        while proc.poll() is None and time.time() < deadline:
            done = out.read_bytes().count(b"\n") if out.exists() else 0
            if done >= 3:
                stages = descendants(proc.pid)
                os.kill(proc.pid, signal.SIGKILL)
                killed = done
                break
            time.sleep(0.02)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert killed is not None and killed < 40, f"the job ended before the driver could be killed mid-way ({killed})"
    assert stages, "the job's stage processes were not found"
    gone = time.time() + 30
    while any(alive(p) for p in stages) and time.time() < gone:
        time.sleep(0.2)
    assert not [p for p in stages if alive(p)], "stage processes outlived their driver"
    data = out.read_bytes()
    kept = [json.loads(x) for x in data[:data.rfind(b"\n") + 1].splitlines()]  # whole lines (a torn tail aside)

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout == "", done.stderr[-3000:]
    lines = read_output(out)
    assert len(lines) == 40 and {x["id"]: x for x in lines} == uninterrupted
    assert lines[:len(kept)] == kept and f"{len(kept)} already there" in done.stderr
