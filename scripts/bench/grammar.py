"""Grammar engines side by side on the bundled tokenizer: llguidance vs outlines-core.

Compile time and token-mask time per token while walking a valid JSON answer, for llguidance and
outlines-core. Prints a table.

    python -m scripts.bench grammar
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from batcher.tokenizer.tokenizer import load_tokenizer
from scripts.bench._shared import parser

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["maths", "engines", "notes"]},
                    separators=(",", ":"))


def bench_llguidance(tok, ids: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt

    llt = llguidance.hf.from_tokenizer(tok.hf)  # once per process, not per request
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(llt, grammar)
    compile_s = time.perf_counter() - t0
    mask = lgt.allocate_token_bitmask(1, llt.vocab_size)
    times = []
    for t in ids:
        t1 = time.perf_counter()
        lgt.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - t1)
        assert m.consume_token(t), m.get_error()
    return compile_s, times


def bench_outlines(tok, ids: list[int]) -> tuple[float, list[float]]:
    from outlines_core import Guide, Index, Vocabulary, json_schema

    eos = tok.hf.eos_token_id
    vocab: dict[str, list[int]] = {}
    for piece, i in tok.hf.get_vocab().items():
        if i != eos:
            vocab.setdefault(piece, []).append(i)
    vocabulary = Vocabulary(eos, vocab)  # once per process
    t0 = time.perf_counter()
    regex = json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = Index(regex, vocabulary)
    guide = Guide(index)
    compile_s = time.perf_counter() - t0
    mask = torch.zeros((len(tok.hf) + 31) // 32, dtype=torch.int32)
    times = []
    for t in ids:
        t1 = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        times.append(time.perf_counter() - t1)
        guide.advance(t)
    return compile_s, times


def main(argv: list[str]) -> None:
    parser(__name__, __doc__, raw=True).parse_args(argv)
    tok = load_tokenizer()
    ids = tok.encode(ANSWER, add_special_tokens=False)
    print("| engine | compile ms | mask us/token median | p90 | tokens |")
    print("|---|---|---|---|---|")
    for name, fn in (("llguidance", bench_llguidance), ("outlines-core", bench_outlines)):
        try:
            compile_s, times = fn(tok, ids)
        except Exception as exc:  # noqa: BLE001 (report the engine that failed, run the other)
            print(f"| {name} | failed: {type(exc).__name__}: {exc} | | | |")
            continue
        times.sort()
        print(f"| {name} | {compile_s * 1e3:.0f} | {statistics.median(times) * 1e6:.0f} | "
              f"{times[int(len(times) * 0.9)] * 1e6:.0f} | {len(ids)} |")

