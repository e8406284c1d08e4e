"""A TCP relay that adds a fixed one-way delay in each direction: the slow links' latency.

This machine's kernel has no ``sch_netem`` (tc can shape rate, with tbf, but not delay), so the
delay of a slow link is added here, in the server's namespace, in front of the service: each chunk
read from one side is written to the other ``delay`` seconds later, in order. The bytes still
cross the shaped veth. ``python -m vericache.remote.relay LISTEN_HOST:PORT TARGET_HOST:PORT ONE_WAY_DELAY_MS``.
"""

from __future__ import annotations

import asyncio
import sys
import time


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, chunk = await queue.get()
            if chunk is None:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(chunk)
            await writer.drain()
        writer.close()

    task = asyncio.create_task(deliver())
    try:
        while chunk := await reader.read(1 << 20):
            queue.put_nowait((time.monotonic() + delay, chunk))
    except ConnectionError:
        pass
    queue.put_nowait((0.0, None))
    try:
        await task
    except ConnectionError:
        pass


async def _serve(listen: tuple[str, int], target: tuple[str, int], delay: float) -> None:
    async def handle(reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_writer, delay), _pump(up_reader, writer, delay))

    server = await asyncio.start_server(handle, *listen)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def _addr(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


if __name__ == "__main__":
    asyncio.run(_serve(_addr(sys.argv[1]), _addr(sys.argv[2]), float(sys.argv[3]) / 1e3))
