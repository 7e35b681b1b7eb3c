"""A server's start-up heap, taken out of the garbage collector's sight.

Once the model, the tokenizer and the modules are loaded, a `batcher serve` process holds about
210,000 long-lived objects with the bundled model, and every full (generation 2) collection walks
them all: about 95 ms on a 2-core CPU, with the GIL held, so the event loop and the model step
stop together. Under load such a collection comes every so often (5 in a minute of the bundled
model's overload benchmark, 22-117 ms each), and each is a stall in every stream's tokens and in
every answer, refusals included. `gc.freeze()` moves everything alive at the end of start-up into
a permanent generation that collections skip; what requests allocate afterwards is collected as
before. Servers call it once they are ready to listen; a library that embeds the engine leaves
its host's collector alone.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then exempt every surviving object from later collections."""
    gc.collect()
    gc.freeze()
