"""Reasoning output of thinking models (`--reasoning-parser`): the text between `<think>` and
`</think>` is the answer's `reasoning_content`, the rest its `content`, as vLLM and SGLang answer.

- `qwen3`: an answer that opens with `<think>` (leading whitespace aside) reasons until
  `</think>`; one that does not is all content (`enable_thinking: false`: the chat template
  closes an empty think block in the prompt).
- `deepseek_r1`: the chat template opens the think block in the prompt, so an answer reasons from
  its first token until `</think>` (an opening `<think>` it writes itself is dropped); an answer
  that never closes it is all reasoning.

Streams split as they go: text that may be the start of a tag is held back until the next
delta tells, so a tag split across tokens never leaks into either field. A whole answer is split
by the same code, so both ways give the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(slots=True, frozen=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool  # no opening tag needed (the prompt opened the block)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_in_reasoning)

    def parse(self, text: str) -> tuple[str | None, str]:
        """A whole answer -> (reasoning or None, content)."""
        s = self.stream()
        r1, c1 = s.feed(text)
        r2, c2 = s.end()
        reasoning = r1 + r2
        return (reasoning if s.reasoned else None), c1 + c2


PARSERS = {"qwen3": ReasoningParser("qwen3", False),
           "deepseek_r1": ReasoningParser("deepseek_r1", True)}


def reasoning_parser_names() -> list[str]:
    return sorted(PARSERS)


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name in (None, "", "none"):
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{reasoning_parser_names()}")
    return PARSERS[name]


def _held(buf: str, tag: str) -> int:
    """Length of the longest end of `buf` that begins `tag` (kept until the next delta)."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


class ReasoningStream:
    """One choice's split: `feed(delta)` -> (reasoning delta, content delta); `end()` flushes."""

    def __init__(self, starts_in_reasoning: bool):
        self.default = "reasoning" if starts_in_reasoning else "content"
        self.state = "start"
        self.buf = ""
        self.reasoned = starts_in_reasoning

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.buf:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.state, self.reasoned = head[len(OPEN):], "reasoning", True
                elif not final and (not head or OPEN.startswith(head)):
                    break  # may still open a think block
                else:
                    self.state = self.default
            elif self.state == "reasoning":
                at = self.buf.find(CLOSE)
                if at >= 0:
                    reasoning.append(self.buf[:at])
                    self.buf, self.state = self.buf[at + len(CLOSE):], "content"
                    continue
                keep = 0 if final else _held(self.buf, CLOSE)
                reasoning.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            else:
                content.append(self.buf)
                self.buf = ""
        return "".join(reasoning), "".join(content)

    def end(self) -> tuple[str, str]:
        return self.feed("", final=True)
