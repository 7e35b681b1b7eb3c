"""A client that trickles a request's header block one byte at a time (slowloris), shared by the
replica's and the router's header-timeout tests."""

from __future__ import annotations

import asyncio
import time


async def trickle_headers(port: int, head: bytes, timeout_s: float,
                          silent: bool = False) -> tuple[float, bytes]:
    """Send `head` a byte at a time (or nothing at all when `silent`) to 127.0.0.1:`port`;
    return how long until the server hung up and what it sent back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start, got = time.monotonic(), b""
    try:
        for byte in b"" if silent else head:
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                got += await asyncio.wait_for(reader.read(100), 0.05)
            except TimeoutError:
                continue
            if reader.at_eof():
                break
        else:
            got += await asyncio.wait_for(reader.read(), 4 * timeout_s)
    except (ConnectionError, TimeoutError):
        pass
    finally:
        writer.close()
    return time.monotonic() - start, got
