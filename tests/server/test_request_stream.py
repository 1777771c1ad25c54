"""The per-request hand-off: it fills at ``capacity`` chunks or ``capacity_bytes`` bytes, whichever comes
first, says so once, and resumes once drained to ``resume_depth`` chunks and half its bytes."""

from __future__ import annotations

import asyncio

from kvpilot.engine.server.request_stream import RequestStream


def test_bytes_fill_the_stream_before_its_chunk_count_and_drain_to_half():
    async def main() -> None:
        resumed: list[int] = []
        stream = RequestStream(asyncio.get_running_loop(), 16, 8, lambda: resumed.append(stream.nbytes), 1000)
        assert [stream.put(i, 300) for i in range(4)] == [False, False, False, True]  # 1200 >= 1000
        assert (stream.depth, stream.nbytes, stream.backpressured) == (4, 1200, True)
        assert stream.put(4, 300) is False  # already paused: said once (1500 bytes now)
        assert [await stream.get() for _ in range(3)] == [0, 1, 2]
        assert (
            resumed == [] and stream.backpressured
        )  # 600 bytes left: over half of 1000 (4 chunks: under resume_depth)
        assert await stream.get() == 3
        assert resumed == [300] and not stream.backpressured  # resumed once, at 300 bytes
        assert stream.put(5, 300) is False  # 600 again: below the bound
        assert [await stream.get() for _ in range(2)] == [4, 5] and resumed == [300]

    asyncio.run(main())


def test_without_a_byte_bound_only_chunks_count():
    async def main() -> None:
        stream = RequestStream(asyncio.get_running_loop(), 3, 1, lambda: None)
        assert [stream.put(i, 10**9) for i in range(3)] == [False, False, True]

    asyncio.run(main())


def test_a_steps_waiting_handlers_are_woken_together_by_wake_all():
    """Handlers already waiting when the engine thread puts their chunks wake only at ``wake_all`` (one
    thread hop per step, not one per request), and then each gets its own chunk."""
    import threading

    from kvpilot.engine.server.request_stream import Wakes, wake_all

    async def main() -> None:
        loop = asyncio.get_running_loop()
        streams = [RequestStream(loop, 4, 1, lambda: None) for _ in range(3)]
        getters = [asyncio.ensure_future(s.get()) for s in streams]
        await asyncio.sleep(0)  # every handler is waiting now
        wakes: Wakes = {}
        hops = []
        real = loop.call_soon_threadsafe

        def counting(*args):
            hops.append(args)
            return real(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        put = threading.Thread(target=lambda: [s.put(i, 1, wakes) for i, s in enumerate(streams)])
        put.start()
        put.join()
        await asyncio.sleep(0.05)
        assert not any(g.done() for g in getters) and hops == []  # collected, not woken
        threading.Thread(target=wake_all, args=(wakes,)).start()
        assert await asyncio.wait_for(asyncio.gather(*getters), 5) == [0, 1, 2]
        assert len(hops) == 1

    asyncio.run(main())
