"""Generated text split into the answer's text and the calls, incrementally, as it streams.

The grammar (slipstream/grammar/tool_calls.py) fixes the layout of every call, so reading it back
needs no guessing: the text before the syntax's trigger is the answer's text (`content`); after it,
each `{"name": "<name>", "<args_key>": ` starts call i (its id and name are known then) and its
arguments are the JSON value that follows, read with a bracket and string scanner (fragments are
passed on as they arrive); what lies between calls (tags, separators) is the syntax's frame and
is skipped. A text that may still become the trigger is held back until it is decided.

A complete answer is parsed by the same parser in one `push` (`parse`), so a stream's deltas
reassemble to exactly the non-streamed answer. A call cut off by max_tokens keeps the arguments it
had (OpenAI does the same: finish_reason "length", arguments not complete JSON).
"""
from __future__ import annotations

import secrets

from slipstream.grammar.tool_calls import ToolSyntax
from slipstream.outputs import ToolCall, ToolCallDelta


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallParser:
    """`push(text)` → (content, call deltas) for the new text; `finish()` releases what was held back.

    `required`: the output is calls from its first character. `auto`: text until the trigger (or,
    `at_start`, calls only if the output begins with the trigger)."""

    def __init__(self, syntax: ToolSyntax, required: bool, at_start: bool = False, new_id=new_call_id) -> None:
        self.syntax = syntax
        self._new_id = new_id
        self._state = "calls" if required else ("decide" if at_start or syntax.at_start else "text")
        self._buf = ""  # text not yet consumed by the state
        self._head = '{"name": "'
        self._key = f'", "{syntax.args_key}": '
        self._depth = 0
        self._in_string = self._escape = False
        self.content = ""  # everything emitted as content so far
        self.calls: list[list[str]] = []  # [id, name, arguments so far]

    # --- public ----------------------------------------------------------------------------------

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content, deltas = "", list[ToolCallDelta]()
        while self._buf:
            before = (self._state, len(self._buf))
            content += self._step(deltas)
            if (self._state, len(self._buf)) == before:
                break  # needs more text
        self.content += content
        return content, _merge(deltas)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the output: held-back text that never became the trigger is content."""
        content = ""
        if self._state in ("text", "decide", "plain"):
            content, self._buf = self._buf, ""
        self.content += content
        return content, []

    def result(self) -> tuple[str, list[ToolCall]]:
        return self.content, [ToolCall(i, n, a) for i, n, a in self.calls]

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        self.push(text)
        self.finish()
        return self.result()

    # --- states ------------------------------------------------------------------------------------

    def _step(self, deltas: list[ToolCallDelta]) -> str:
        """Consume some of the buffer; return content it produced (calls go to `deltas`)."""
        trigger, buf = self.syntax.trigger, self._buf
        if self._state == "plain":
            self._buf = ""
            return buf
        if self._state == "decide":
            if len(buf) < len(trigger) and trigger.startswith(buf):
                return ""
            self._state = "calls" if buf.startswith(trigger) else "plain"
            return ""
        if self._state == "text":
            at = buf.find(trigger)
            if at >= 0:
                self._state, self._buf = "calls", buf[at:]
                return buf[:at]
            keep = _partial_suffix(buf, trigger)
            self._buf = buf[len(buf) - keep:]
            return buf[:len(buf) - keep]
        if self._state == "calls":  # the frame before a call's name
            at = buf.find(self._head)
            if at < 0:
                self._buf = buf[max(0, len(buf) - len(self._head) + 1):]
                return ""
            self._state, self._buf = "name", buf[at + len(self._head):]
            return ""
        if self._state == "name":
            end = buf.find('"')
            if end < 0:
                return ""
            call = [self._new_id(), buf[:end], ""]
            self.calls.append(call)
            deltas.append(ToolCallDelta(len(self.calls) - 1, call[0], call[1], ""))
            self._state, self._buf = "key", buf[end:]
            return ""
        if self._state == "key":
            if len(buf) < len(self._key):
                return ""
            if not buf.startswith(self._key):  # not the grammar's layout: look for the next call
                self._state = "calls"
                return ""
            self._state, self._buf = "args", buf[len(self._key):]
            self._depth, self._in_string, self._escape = 0, False, False
            return ""
        # "args": the arguments' JSON value, up to its closing bracket
        n, done = self._scan(buf)
        if n:
            self.calls[-1][2] += buf[:n]
            deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=buf[:n]))
        self._buf = buf[n:]
        if done:
            self._state = "calls"
        return ""

    def _scan(self, buf: str) -> tuple[int, bool]:
        """How many characters of `buf` belong to the arguments, and whether they end there: at the
        bracket that closes them, or, for a value that is not an object or a list (a grammar that let
        the model write a scalar), before the call's own closing `}`, which is never arguments."""
        for i, c in enumerate(buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                if self._depth == 0:
                    return i, True
                self._depth -= 1
                if self._depth == 0:
                    return i + 1, True
        return len(buf), False


def _partial_suffix(text: str, trigger: str) -> int:
    """The length of the longest end of `text` that is a proper start of `trigger` (held back)."""
    for k in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-k:]):
            return k
    return 0


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One delta per call: its start (id, name) and its argument fragments joined."""
    out: dict[int, ToolCallDelta] = {}
    for d in deltas:
        prev = out.get(d.index)
        out[d.index] = d if prev is None else ToolCallDelta(d.index, prev.id or d.id, prev.name or d.name,
                                                            prev.arguments + d.arguments)
    return [out[i] for i in sorted(out)]
