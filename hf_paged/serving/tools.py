"""Tool calls in chat: the tools go to the chat template, and the model's answer is parsed
back into OpenAI `tool_calls`.

With `tool_choice="auto"` the model writes calls in its own format, found by a parser:

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number (Hermes,
               Qwen 2.5 / 3)
  llama3_json  {"name": ..., "parameters": {...}} as the whole answer, calls separated by
               ";", an optional <|python_tag|> first (Llama 3.1 / 3.2 JSON tool calling)
  mistral      [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...] (Mistral)

`auto_parser` picks one from the chat template. With `tool_choice="required"` or a named
function the answer is instead constrained (structured outputs) to JSON that is the calls
themselves, so its arguments always parse and match the function's schema: for a named
function, its arguments object; for "required", a list of {"name", "parameters"} objects
(one at most without parallel_tool_calls).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..errors import APIError

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def auto_parser(chat_template: str | None) -> str:
    """The parser a chat template's own tool-call format needs (hermes if none is seen)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def check_tools(tools: list | None, tool_choice) -> None:
    """APIError 400 for tools or a tool_choice OpenAI would refuse."""
    names = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                           "{\"name\": ..., \"parameters\": {...}}}.", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object.",
                           "tools")
        names.append(fn["name"])
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or name not in names:
            raise APIError(400, f"tool_choice names a function the request's tools do not "
                           f"have; it has {names}.", "tool_choice")
    elif tool_choice not in (None, "none", "auto", "required"):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
    elif tool_choice == "required" and not names:
        raise APIError(400, "tool_choice 'required' needs tools.", "tool_choice")


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def forced_schema(tools: list, tool_choice, parallel: bool) -> dict | None:
    """The JSON schema an answer must follow for `tool_choice` (None: not forced)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return _parameters(next(t for t in tools if t["function"]["name"] == name))
    if tool_choice != "required":
        return None
    call = {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": t["function"]["name"]},
                                      "parameters": _parameters(t)},
                       "required": ["name", "parameters"], "additionalProperties": False}
                      for t in tools]}
    schema = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, tool_choice) -> list[ToolCall]:
    """The calls of an answer constrained by `forced_schema`."""
    value = json.loads(text)
    if isinstance(tool_choice, dict):
        return [ToolCall(tool_choice["function"]["name"], json.dumps(value, ensure_ascii=False))]
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates read them: an assistant's tool-call arguments as
    objects (templates write them with `tojson`), not JSON strings."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function") or {}, dict) for c in calls)):
            raise APIError(400, f"messages[{i}].tool_calls must be a list of {{\"id\": ..., "
                           "\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": "
                           "...}}.", "messages")
        if calls:
            m = dict(m, tool_calls=[_template_call(c) for c in calls])
        out.append(m)
    return out


def _template_call(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass  # (a template may take it as text)
    return dict(call, function=fn)


# -- parsing a model's own format -------------------------------------------------------------
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _call_of(obj, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else
                    json.dumps(args, ensure_ascii=False))


def _json_calls(text: str, arguments_key: str) -> list[ToolCall] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(item, arguments_key) for item in items]
    return None if not calls or None in calls else calls


def calls_at(parser: str, text: str) -> tuple[int, list[ToolCall]]:
    """(where in `text` the calls begin, the calls) of an answer in `parser`'s format;
    (len(text), []) with no complete call: all content. `text` is decoded with special
    tokens (markers may be special)."""
    none = len(text), []
    if parser == "hermes":
        calls = []
        for match in _HERMES.finditer(text):
            found = _json_calls(match.group(1), "arguments")
            if found is None:
                return none
            calls += found
        return (text.index("<tool_call>"), calls) if calls else none
    if parser == "mistral":
        if "[TOOL_CALLS]" not in text:
            return none
        start = text.index("[TOOL_CALLS]")
        calls = _json_calls(text[start + len("[TOOL_CALLS]"):].strip(), "arguments")
        return none if calls is None else (start, calls)
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return none
        calls = []
        for part in body.split(";"):
            found = _json_calls(part.strip(), "parameters")
            if found is None:
                return none
            calls += found
        return 0, calls
    raise ValueError(f"unknown tool-call parser {parser!r}; known: {PARSERS}")


def raw_text(tokenizer, out) -> str:
    """A completion's text with special tokens (tool-call markers may be special), the
    EOS or stop token that ended it left out."""
    ids = out.token_ids
    if out.finish_reason == "stop" and not isinstance(out.stop_reason, str) and ids:
        ids = ids[:-1]  # (an EOS or a stop token)
    return tokenizer.decode(ids, skip_special_tokens=False)


def shown_text(ids: list[int], raw: str, end: int, decode, skip_special_tokens: bool) -> str:
    """The client's text of `raw[:end]`, where `raw` is `ids` decoded with special tokens:
    the tokens whose raw text ends by `end`, decoded as the request decodes (special tokens
    left out where it skips them), and the start of a token that runs past `end`."""
    low, high = 0, len(ids)
    while low < high:  # (the raw text grows with the tokens, mostly: see below)
        mid = (low + high + 1) // 2
        if len(decode(ids[:mid], skip_special_tokens=False)) <= end:
            low = mid
        else:
            high = mid - 1
    # A character's byte tokens decode to a replacement character each until its last one:
    # back to a boundary of whole characters.
    head = decode(ids[:low], skip_special_tokens=False)
    while not raw.startswith(head):
        low -= 1
        head = decode(ids[:low], skip_special_tokens=False)
    return decode(ids[:low], skip_special_tokens=skip_special_tokens) + raw[len(head):end]


def marker(parser: str) -> str:
    """Text whose start a stream holds back: it may begin a tool call."""
    return {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{"}[parser]


@dataclass
class ToolMode:
    """How a chat request's answers become tool calls."""

    parser: str
    choice: object  # "auto", "required" or {"type": "function", "function": {"name": ...}}
    parallel: bool
    skip_special_tokens: bool = True  # the request's: how its content reads

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def finish_reason(self, out, calls: list) -> str | None:
        """A finished answer's `finish_reason`: "tool_calls" where it made calls, but for a
        named function the answer's own ("stop"; "length" if cut short), as OpenAI and vLLM
        answer a call the request forced by name."""
        return "tool_calls" if calls and not isinstance(self.choice, dict) else out.finish_reason

    def answer(self, out, tokenizer) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished completion: calls are found in its text with
        special tokens (`raw_text`), the content before them reads as `out.text` does."""
        if self.forced:
            try:
                return None, forced_calls(out.text, self.choice)
            except (json.JSONDecodeError, KeyError, TypeError):
                return out.text, []  # cut short by max_tokens: not a call
        raw = raw_text(tokenizer, out)
        start, calls = calls_at(self.parser, raw)
        if not calls:
            return out.text, []
        content = shown_text(out.token_ids, raw, start, tokenizer.decode,
                             self.skip_special_tokens)
        return content.rstrip() or None, calls if self.parallel else calls[:1]

    def holds(self, out, tokenizer) -> bool:
        """While streaming: the answer so far may be a call (stop sending it as content)."""
        if self.forced:
            return True
        raw = raw_text(tokenizer, out)
        if self.parser == "llama3_json":
            return raw.lstrip().startswith(("{", "<|python_tag|>"))
        return marker(self.parser) in raw
