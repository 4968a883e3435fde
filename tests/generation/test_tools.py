"""Tool calls (generation/tools.py, issue 51): a template's format found from its text, calls read
back from an answer in each format (malformed ones left as content), the grammar that forces a call
takes exactly the calls the format allows, and a chat with tools and a tool-call history renders as
transformers' apply_chat_template renders it."""

from __future__ import annotations

import json

import pytest

from tests.support.json_tokenizer import HERMES, JSON_EOS, build_json_tokenizer
from tvmpipe.generation.tools import ToolCall, call_grammar, parse_tool_calls, tool_format

LLAMA3 = ("{%- if tools %}{{- 'Environment: ipython' }}{%- endif %}{%- for m in messages %}"
          "{%- if m.role == 'ipython' %}{{- m.content }}{%- elif m.tool_calls %}{{- '<|python_tag|>' }}"
          "{%- else %}{{- m.content }}{%- endif %}{%- endfor %}")
FUNCTIONS = [{"name": "city", "parameters": {"properties": {"c": {"enum": ["Paris", "Rome"]}}, "required": ["c"],
                                             "additionalProperties": False}},
             {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                            "required": ["a"], "additionalProperties": False}}]


def test_formats_are_read_from_the_template():
    assert tool_format(HERMES) == "hermes" and tool_format(LLAMA3) == "llama3"
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None


@pytest.mark.parametrize("text,fmt,content,calls", [
    ('Sure.\n<tool_call>\n{"name": "city", "arguments": {"c": "Rome"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>', "hermes", "Sure.",
     [ToolCall("city", '{"c": "Rome"}'), ToolCall("add", '{"a": 2}')]),
    ('<tool_call>\n{"name": "city", "arguments": {"c": "Rome"}}\n</tool_call>', "hermes", None,
     [ToolCall("city", '{"c": "Rome"}')]),
    ('<tool_call>\n{"name": "city", "arguments": {"c": \n</tool_call>', "hermes", None, []),  # malformed: content
    ("just text", "hermes", "just text", []),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "city", "parameters": {"c": "Paris"}}',
     "llama3", None, [ToolCall("add", '{"a": 1}'), ToolCall("city", '{"c": "Paris"}')]),
    ('{"name": "add", "parameters": {"a": 1}', "llama3", None, []),
    ("The answer is 4.", "llama3", "The answer is 4.", []),
])
def test_calls_are_read_back(text, fmt, content, calls):
    got_content, got = parse_tool_calls(text, fmt)
    assert got == calls
    assert got_content == (content if calls else text)


def test_the_call_grammar_takes_exactly_a_call_of_the_named_functions(tmp_path):
    import llguidance

    tok = build_json_tokenizer(tmp_path / "tok")
    lt = llguidance.LLTokenizer((tok / "tokenizer.json").read_text(), n_vocab=128, eos_token=[JSON_EOS])
    from tokenizers import Tokenizer

    enc = Tokenizer.from_file(str(tok / "tokenizer.json"))

    def takes(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(lt, grammar)
        return m.consume_tokens(enc.encode(text).ids) and m.is_accepting()

    both = call_grammar("hermes", FUNCTIONS)
    assert takes(both, '<tool_call>\n{"name": "city", "arguments": {"c": "Rome"}}\n</tool_call>')
    assert takes(both, '<tool_call>\n{"name": "add", "arguments": {"a": 12}}\n</tool_call>')
    assert not takes(both, '<tool_call>\n{"name": "city", "arguments": {"c": "Oslo"}}\n</tool_call>')
    assert not takes(both, '<tool_call>\n{"name": "add", "arguments": true}\n</tool_call>')
    named = call_grammar("hermes", FUNCTIONS[1:])
    assert not takes(named, '<tool_call>\n{"name": "city", "arguments": {"c": "Rome"}}\n</tool_call>')
    llama = call_grammar("llama3", FUNCTIONS[:1])
    assert takes(llama, '{"name": "city", "parameters": {"c": "Paris"}}')


def test_a_chat_with_tools_renders_as_transformers(tmp_path):
    pytest.importorskip("transformers")  # the oracle (the compile extra)
    from transformers import AutoTokenizer

    from tvmpipe.generation.text import load_text_codec

    tok = build_json_tokenizer(tmp_path / "tok")
    codec = load_text_codec(tok)
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Rome?"},
               {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                     "function": {"name": "city", "arguments": {"c": "Rome"}}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"sky": "clear"})}]
    want = AutoTokenizer.from_pretrained(str(tok)).apply_chat_template(history, tools=tools, add_generation_prompt=True,
                                                                       tokenize=False)
    assert codec.render_chat(history, tools=tools) == want
    assert "<tools>" in want and '"arguments": {"c": "Rome"}' in want and "<tool_response>" in want


def test_a_streamed_answer_sends_content_never_a_call():
    """ToolStream: content goes out as it comes, the start of a call (or what could begin it) is
    held, the calls and the rest come at the end; a llama3 answer that starts as JSON is held."""
    from tvmpipe.generation.tools import ToolStream

    text = 'Let me check.\n<tool_call>\n{"name": "city", "arguments": {"c": "Rome"}}\n</tool_call>'
    s = ToolStream("hermes")
    sent = "".join(s.push(text[i:i + 3]) for i in range(0, len(text), 3))
    assert sent == "Let me check.\n" and "<" not in sent
    rest, calls = s.finish()
    assert rest == "" and calls == [ToolCall("city", '{"c": "Rome"}')]
    s = ToolStream("hermes")
    assert s.push("a <tool") == "a " and s.push("box>") == "<toolbox>"  # held while it could begin a call
    assert s.finish() == ("", [])
    s = ToolStream("llama3")
    assert s.push(' {"name": "add", ') == "" and s.push('"parameters": {"a": 1}}') == ""
    assert s.finish() == ("", [ToolCall("add", '{"a": 1}')])
    s = ToolStream("llama3")
    assert s.push("It is ") == "It is " and s.push("4.") == "4." and s.finish() == ("", [])
    forced = ToolStream("hermes", forced=True)
    assert forced.push("<tool_call>") == "" and forced.finish() == ("<tool_call>", [])
