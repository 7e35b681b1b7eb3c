"""A batch line checked as its live request would be, once, when the batch is created: the
protocol's parsing, the tokenizer, the context and KV limits. A line that can never run is
answered there with the live endpoint's 4xx (it goes to the error file and never waits for
capacity); every other line gets its cost, prompt tokens and max output tokens over all its
choices, which the executor sizes it by without reading the line again.

Runs in a worker thread: `check` touches nothing the event loop owns except read-only
configuration and the tokenizer (which the gateway already calls from worker threads).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from batcher.batch.jsonl import (
    MAX_LINE_BYTES,
    MAX_LINES,
    InputChecker,
    InputLine,
    LineProblem,
    iter_lines,
)
from batcher.batch.line_rows import STAGE_ROWS, line_rows
from batcher.batch.lines import LineResult, output_line
from batcher.http.errors import ApiError, invalid
from batcher.server.gateway import Gateway
from batcher.server.protocol import GenerationSpec, parse_generation

GENERATION = {"/v1/chat/completions": True, "/v1/completions": False}
# Bytes of line bodies staged per chunk (besides `STAGE_ROWS`): one chunk's insert stays short.
STAGE_BYTES = 4 << 20


class LineCheck:
    """Validates line bodies against a gateway's model and limits."""

    def __init__(self, gw: Gateway):
        self.gw = gw

    def cost(self, url: str, body: dict[str, Any]) -> tuple[int, int]:
        """(prompt tokens, max output tokens) of the line, all choices counted; ApiError with
        the status the live endpoint would answer when it can never run."""
        if url == "/v1/embeddings":
            return self._embedding(body)
        gw = self.gw
        spec = parse_generation(body, GENERATION[url], {gw.cfg.model_name},
                                gw.tokenizer.vocab_size, gw.tool_parser)
        if spec.stream:
            raise invalid("a batch request cannot stream", "stream")
        gw.check_choices(len(spec.prompts) or 1, spec.n)
        prompts = self._encode(spec)
        gw.fit_context(spec, prompts)
        copies = spec.n
        need = max(len(p) for p in prompts) + spec.sampling.max_tokens
        kv = gw.engine.kv
        # NOTE: the scheduler refuses a request needing more KV than the whole pool (a 400 at
        # admission); found here, the line is answered now instead of waiting to be refused.
        if kv.blocks_needed(need - 1) > kv.num_total_blocks:
            raise ApiError(400, f"the request needs more KV cache than this server holds "
                           f"({need} tokens)", param="max_tokens",
                           code="context_length_exceeded")
        return (sum(len(p) for p in prompts) * copies,
                spec.sampling.max_tokens * len(prompts) * copies)

    def _encode(self, spec: GenerationSpec) -> list[list[int]]:
        tok = self.gw.tokenizer
        try:
            if spec.chat:
                out = [tok.apply_chat_template(spec.messages, tools=spec.chat_tools)]
            else:
                out = [p if isinstance(p, list) else tok.encode(p) for p in spec.prompts]
        except ValueError as exc:
            raise invalid(str(exc), "messages" if spec.chat else "prompt") from exc
        if not all(out):
            raise invalid("the prompt is empty", "messages" if spec.chat else "prompt")
        return out

    def _embedding(self, body: dict[str, Any]) -> tuple[int, int]:
        from batcher.server.embeddings_route import _inputs

        gw = self.gw
        if gw.embedder is None:
            raise ApiError(404, "this server has no embedding model", code="model_not_found")
        model, items, _ = _inputs(body)
        if model != gw.embedder_name:
            raise invalid(f"model '{model[:64]}' is not served here; available: "
                          f"['{gw.embedder_name}']", "model", "model_not_found")
        if len(items) > gw.embedder.max_queue:
            raise invalid(f"'input' takes at most {gw.embedder.max_queue} strings on this "
                          "server", "input")
        # Embeddings run beside the engine (their own batcher), not in its KV cache.
        return 0, 0


class StagedInput:
    """A batch's input file read a chunk at a time, each chunk's lines checked as the upload
    checks them and validated (`LineCheck`), as store rows (`line_rows`). `next_rows` runs in a
    worker thread; the event loop stores each chunk in a short transaction between calls, so
    a 50,000-line file never holds the loop, and at most one chunk of lines is in memory."""

    def __init__(self, path: Path, batch_id: str, endpoint: str, check: LineCheck | None,
                 max_lines: int = MAX_LINES, max_line_bytes: int = MAX_LINE_BYTES):
        self.batch_id = batch_id
        self.check = check
        self.checker = InputChecker(endpoint, max_lines, True, max_line_bytes)
        self.answered = 0  # lines answered at creation (they can never run)
        self._f = path.open("rb")  # a file deleted meanwhile stays readable through it
        self._lines = iter_lines(self._f, max_line_bytes)

    def close(self) -> None:
        self._f.close()

    @property
    def total(self) -> int:
        return self.checker.accepted

    def problems(self) -> list[LineProblem]:
        """After the last chunk: what is wrong with the file as a whole (empty when it runs)."""
        return self.checker.finish()

    def next_rows(self, max_rows: int = STAGE_ROWS, max_bytes: int = STAGE_BYTES
                  ) -> list[tuple[Any, ...]] | None:
        """The next chunk's rows; None at the end of the file. Once the file has a problem the
        rest is only checked (for its other problems), not validated."""
        lines: list[InputLine] = []
        size = 0
        for lineno, raw in self._lines:
            line = self.checker.add(lineno, raw)
            if line is None or self.checker.problems or self.checker.too_many:
                continue
            lines.append(self._validated(line))
            size += len(raw or b"")
            if len(lines) >= max_rows or size >= max_bytes:
                break
        else:
            if not lines:
                return None
        if self.checker.problems or self.checker.too_many:
            return []  # nothing more to store: the batch will fail
        return line_rows(self.batch_id, lines)

    def _validated(self, line: InputLine) -> InputLine:
        if self.check is None:
            return line
        try:
            return replace(line, cost=self.check.cost(line.url, line.body))
        except ApiError as err:
            self.answered += 1
            return replace(line, answer=(err.status, output_line(
                line.custom_id, LineResult(err.status, err.body()))))
