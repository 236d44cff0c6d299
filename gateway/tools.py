"""OpenAI tool calling: ``tools`` and ``tool_choice`` → a constraint, and outputs →
``message.tool_calls`` (streamed as tool-call deltas).

- ``"required"``: the output is a JSON array of calls ``[{"name": ..., "arguments":
  {...}}]``, each naming one of the tools with arguments valid for its parameter
  schema (one call unless ``parallel_tool_calls``);
- a named function: the output is that function's arguments;
- ``"auto"``: the tools go to the chat template and the model writes text or calls
  in the Hermes format (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
  Qwen2.5/Qwen3's); a structural tag makes every call it starts valid. A template
  that renders no tools cannot offer them, so the request is answered as ``"none"``
  and the response says so (``warnings``); without ``parallel_tool_calls`` only the
  first call is kept;
- ``"none"``: the tools reach the template, nothing is constrained or parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import ApiError
from .params import Fields

__all__ = ["ToolCallStream", "ToolPlan", "parse_tool_calls", "plan_tools"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(CALL_START) + r"\s*(.*?)\s*" + re.escape(CALL_END), re.S)
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # required | named | auto
    constraint: dict[str, str]  # SamplingParams fields
    template_tools: list[dict[str, Any]]  # for the chat template
    name: str = ""  # the named function
    parallel: bool = True  # more than one call allowed (parallel_tool_calls)


def _tools(f: Fields) -> list[dict[str, Any]]:
    raw = f.raw("tools")
    if not isinstance(raw, list) or not raw:
        raise f.bad("tools", "a non-empty list of tools", raw)
    out, seen = [], set()
    for i, item in enumerate(raw):
        tf = Fields(item, f"tools[{i}]")
        if tf.str("type", "function") != "function":
            raise ApiError(400, f"tools[{i}].type must be 'function'", param="tools")
        fn = tf.object("function")
        if fn is None:
            raise ApiError(400, f"tools[{i}] needs a 'function'", param="tools")
        name = fn.str("name") or ""
        if not _NAME.match(name):
            raise ApiError(
                400, f"tools[{i}].function.name must match {_NAME.pattern}", param="tools"
            )
        if name in seen:
            raise ApiError(400, f"two tools are named {name!r}", param="tools")
        seen.add(name)
        fn.str("description")
        params = fn.raw("parameters")
        if params is None:
            params = _EMPTY_PARAMS
        elif not isinstance(params, dict):
            raise fn.bad("parameters", "a JSON schema (an object)", params)
        out.append({"type": "function", "function": {**fn.body, "parameters": params}})
    return out


def _params(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"]["parameters"]


def plan_tools(f: Fields, template_has_tools: bool) -> tuple[ToolPlan | None, list[str]]:
    """What ``tools``/``tool_choice``/``parallel_tool_calls`` ask for, and any warnings."""
    choice = f.raw("tool_choice")
    parallel = f.bool("parallel_tool_calls", True) is not False
    if f.raw("tools") is None:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs 'tools'", param="tool_choice")
        return None, []
    tools = _tools(f)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", {}, tools), []
    if choice == "auto":
        if not template_has_tools:
            warning = (
                "tool_choice 'auto': this model's chat template does not render tools, "
                "so the request was answered as tool_choice 'none'"
            )
            return None, [warning]
        structures = [
            {
                "begin": f'{CALL_START}\n{{"name": "{t["function"]["name"]}", "arguments": ',
                "schema": _params(t),
                "end": f"}}\n{CALL_END}",
            }
            for t in tools
        ]
        tag = {"type": "structural_tag", "structures": structures, "triggers": [CALL_START]}
        plan = ToolPlan("auto", {"structural_tag": json.dumps(tag)}, tools, parallel=parallel)
        return plan, []
    if choice == "required":
        schema = _required_schema(tools)
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", {"json_schema": json.dumps(schema)}, tools), []
    cf = Fields(choice, "tool_choice")
    fn = cf.object("function")
    name = fn.str("name") if fn is not None else None
    if cf.str("type") != "function" or not name:
        raise ApiError(
            400,
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise ApiError(
            400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    return ToolPlan("named", {"json_schema": json.dumps(_params(tool))}, tools, name), []


def _required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """``"required"``'s constraint: a non-empty array of calls, each one tool's name and
    arguments valid for that tool's parameters."""
    defs: dict[str, Any] = {}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": _arguments_schema(t, defs),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if defs:
        schema["$defs"] = defs
    return schema


def _arguments_schema(tool: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters as one branch of the combined schema. Nested there as they
    are, their local refs (``#/$defs/Loc``, ``#`` for recursion) would resolve against
    the combined root, where they name nothing. So parameters with local refs move whole
    to the root's ``$defs``, keyed by the tool's name (unique, and pointer-safe by
    ``_NAME``), their refs re-rooted there: two tools' defs of one name stay apart."""
    params = _params(tool)
    name = tool["function"]["name"]
    moved = _reroot(params, f"#/$defs/{name}")
    if moved == params:
        return params
    # A root $id would make the re-rooted refs resolve against the tool's own schema.
    moved.pop("$id", None)
    defs[name] = moved
    return {"$ref": f"#/$defs/{name}"}


# Keywords whose value maps names to subschemas (a name there is no keyword), and those
# whose value is an instance (data, where a "$ref" key is no reference).
_SCHEMA_MAPS = {
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
    "dependencies",
}
_INSTANCES = {"const", "enum", "default", "examples"}


def _reroot(schema: Any, root: str) -> Any:
    """A copy of ``schema`` whose document-local refs (``#`` and ``#/...``) point into
    ``root`` instead; other refs (URLs, ``#anchor``) are left as written."""
    if isinstance(schema, list):  # allOf, anyOf, oneOf, prefixItems, tuple items
        return [_reroot(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = root + value[1:]
        elif key in _INSTANCES:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _reroot(v, root) for k, v in value.items()}
        else:
            out[key] = _reroot(value, root)
    return out


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a whole output. Text that is not a complete call
    (an output cut by max_tokens) stays content."""
    if plan.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [_call(plan.name, text)]
    if plan.mode == "required":
        calls = _array_calls(text)
        if calls is None:
            return text, []
        return None, [_call(name, arguments) for name, arguments in calls]
    if plan.mode == "auto":
        bodies = _HERMES.findall(text)
        # The calls' bodies as one array, so that "required"'s scan finds each one's
        # arguments as written.
        calls = _array_calls(f"[{', '.join(bodies)}]") if bodies else None
        if calls:
            found = [_call(name, arguments) for name, arguments in calls]
            rest = _HERMES.sub("", text).strip()
            # Without parallel_tool_calls the first call is the answer (a structural tag
            # cannot count calls).
            return rest or None, found if plan.parallel else found[:1]
    return text, []


def _array_calls(text: str) -> list[tuple[str, str]] | None:
    """``(name, arguments)`` of each call in a whole ``[{"name": ..., "arguments": ...}]``,
    the arguments as the model wrote them (what the stream sends): parsed and dumped
    again they would change (``\\u00fc`` for ``ü``, ``1.5`` for ``1.50``, spacing).
    None when ``text`` is not such an array."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    if not isinstance(parsed, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in parsed
    ):
        return None
    scanned = _scan_array(text)
    if len(scanned) != len(parsed) or any(c.args_start < 0 or c.args_end < 0 for c in scanned):
        return None
    return [
        (c["name"], text[s.args_start : s.args_end]) for c, s in zip(parsed, scanned, strict=True)
    ]


@dataclass
class _Call:
    name: str | None = None
    args_start: int = -1
    args_end: int = -1  # -1 while the arguments are still being written


def _scan_array(text: str) -> list[_Call]:
    """The calls of a (maybe unfinished) ``[{"name": ..., "arguments": ...}, ...]``:
    a walk over JSON structure only, enough to stream what each call has so far."""
    calls: list[_Call] = []
    depth, in_str, esc, start = 0, False, False, 0
    key, expect_key, value_key = "", False, ""
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 2:
                    literal = json.loads(text[start : i + 1])
                    if expect_key:
                        key, expect_key = literal, False
                    elif value_key == "name":
                        calls[-1].name = literal
            continue
        if ch == '"':
            in_str, start = True, i
        elif ch in "{[":
            if depth == 1 and ch == "{":
                calls.append(_Call())
                expect_key = True
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 1 and value_key == "arguments":
                calls[-1].args_end = _end_of_value(text, i)
                value_key = ""
            if depth == 2 and value_key == "arguments":
                calls[-1].args_end = i + 1
                value_key = ""
        elif depth == 2 and ch == ":":
            value_key = key
            if key == "arguments":
                calls[-1].args_start = _start_of_value(text, i + 1)
        elif depth == 2 and ch == ",":
            if value_key == "arguments":
                calls[-1].args_end = _end_of_value(text, i)
            value_key, expect_key = "", True
    return calls


def _start_of_value(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _end_of_value(text: str, at: int) -> int:
    while at > 0 and text[at - 1].isspace():
        at -= 1
    return at


@dataclass
class ToolCallStream:
    """One choice's streamed output → OpenAI ``delta.tool_calls`` items (and content)."""

    plan: ToolPlan
    text: str = ""
    sent: list[tuple[str, int]] = field(default_factory=list)  # per call: id, args chars sent
    calling: bool = False  # auto: a call has started (the rest is held to the end)

    def push(self, piece: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """``(content, tool-call deltas)`` for ``piece`` of the output."""
        self.text += piece
        if self.plan.mode == "named":
            return "", self._named(piece)
        if self.plan.mode == "required":
            return "", self._array()
        # auto: content streams until a call starts; the calls go out when it ends.
        out = ""
        if not self.calling:
            at = self.text.find(CALL_START)
            if at < 0:
                keep = 0 if final else _held(self.text, CALL_START)
                out = self.text[: len(self.text) - keep]
                self.text = self.text[len(out) :]
                return out, []
            out, self.text, self.calling = self.text[:at], self.text[at:], True
        if not final:
            return out, []
        content, calls = parse_tool_calls(self.plan, self.text)
        self.text = ""
        return out + (content or ""), [{"index": k, **call} for k, call in enumerate(calls)]

    def _named(self, piece: str) -> list[dict[str, Any]]:
        if not self.sent:
            call = _call(self.plan.name, piece)
            self.sent.append((call["id"], len(piece)))
            return [{"index": 0, **call}]
        return [{"index": 0, "function": {"arguments": piece}}] if piece else []

    def _array(self) -> list[dict[str, Any]]:
        out = []
        for k, call in enumerate(_scan_array(self.text)):
            if call.name is None:
                break
            if k == len(self.sent):
                header = _call(call.name, "")
                self.sent.append((header["id"], 0))
                out.append({"index": k, **header})
            if call.args_start < 0:
                continue
            end = call.args_end if call.args_end >= 0 else len(self.text)
            call_id, done = self.sent[k]
            args = self.text[call.args_start + done : end]
            if args:
                self.sent[k] = (call_id, done + len(args))
                out.append({"index": k, "function": {"arguments": args}})
        return out


def _held(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
