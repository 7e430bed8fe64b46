"""The router's client to engines, against raw HTTP servers on 127.0.0.1 that answer exactly
as each test needs: kept-alive, chunked, ended by close, cut off, or closed under a request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from modelfleet.router.upstream import UpstreamError, Upstreams

from .router_kit import FakeClock, run

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's body; b"" when the client closed instead of sending one."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return b""
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


def answer(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%b\r\n%b" % (
        len(body),
        b"".join(h + b"\r\n" for h in extra),
        body,
    )


@contextlib.asynccontextmanager
async def engine(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A raw server calling `handler(reader, writer, n)` for its n-th connection; yields its
    URL and the list of connections it accepted."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(len(accepted))
        try:
            await handler(reader, writer, len(accepted) - 1)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()


async def echo_kept_alive(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
) -> None:
    while body := await read_request(reader):
        writer.write(answer(body.upper()))
        await writer.drain()


def test_answers_are_read_whole_and_their_connection_is_used_again() -> None:
    async def test() -> None:
        async with engine(echo_kept_alive) as (url, accepted):
            upstreams = Upstreams(connect_timeout=5)
            for word in (b"one", b"two", b"three"):
                got = await upstreams.post(url, "/v1/x", word, [("x-request-id", "r")])
                assert got.status == 200
                assert got.headers["content-length"] == str(len(word))
                assert await got.read() == word.upper()
                assert got.at_eof
                got.release()
            assert accepted == [0]
            upstreams.close()

    run(test())


def test_a_chunked_answer_arrives_piece_by_piece_unchunked() -> None:
    second = asyncio.Event()

    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await second.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def test() -> None:
        async with engine(chunked) as (url, _):
            got = await Upstreams(connect_timeout=5).post(url, "/", b"{}", [])
            assert await got.read() == b"first"  # before the engine has sent the rest
            assert not got.at_eof
            second.set()
            assert await got.read() == b"second"
            assert await got.read() == b""
            assert got.at_eof

    run(test())


def test_an_answer_that_ends_at_close_is_whole_and_its_connection_not_kept() -> None:
    async def until_close(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
    ) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    async def test() -> None:
        async with engine(until_close) as (url, accepted):
            upstreams = Upstreams(connect_timeout=5)
            for _ in range(2):
                got = await upstreams.post(url, "/", b"{}", [])
                parts = [await got.read()]
                while parts[-1]:
                    parts.append(await got.read())
                assert b"".join(parts) == b"all of it"
                got.release()
            assert accepted == [0, 1]

    run(test())


def test_an_answer_cut_short_of_its_length_raises() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await writer.drain()

    async def test() -> None:
        async with engine(cut) as (url, _):
            got = await Upstreams(connect_timeout=5).post(url, "/", b"{}", [])
            assert await got.read() == b"only this"
            with pytest.raises(UpstreamError, match="closed the connection"):
                await got.read()
            assert not got.at_eof

    run(test())


def test_a_refused_connection_and_a_bad_answer_raise_upstream_errors() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def test() -> None:
        async with engine(echo_kept_alive) as (url, _):
            pass  # closed: nothing listens on its port any more
        with pytest.raises(UpstreamError, match="cannot connect"):
            await Upstreams(connect_timeout=5).post(url, "/", b"{}", [])
        async with engine(garbage) as (url, _):
            with pytest.raises(UpstreamError, match="unreadable"):
                await Upstreams(connect_timeout=5).post(url, "/", b"{}", [])
        with pytest.raises(UpstreamError, match="only http"):
            await Upstreams(connect_timeout=5).post("ftp://127.0.0.1:1", "/", b"{}", [])
        with pytest.raises(UpstreamError, match="no client certificate or node name"):
            await Upstreams(connect_timeout=5).post("https://127.0.0.1:1", "/", b"{}", [])

    run(test())


def test_a_kept_alive_connection_closed_under_a_request_is_replaced_by_a_new_one() -> None:
    """The engine closes its idle connection just as the router sends on it: the request goes
    again on a new connection, and the caller never sees the race."""

    async def close_the_second(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        body = await read_request(reader)
        writer.write(answer(body))
        await writer.drain()
        if n == 0:
            await read_request(reader)  # the second request on it: closed unanswered
            return
        await echo_kept_alive(reader, writer, n)

    async def test() -> None:
        async with engine(close_the_second) as (url, accepted):
            upstreams = Upstreams(connect_timeout=5)
            for word in (b"a", b"b"):
                got = await upstreams.post(url, "/", word, [])
                assert await got.read() == word
                got.release()
            assert accepted == [0, 1]

    run(test())


def test_an_idle_connection_past_its_time_is_closed_not_used() -> None:
    async def test() -> None:
        clock = FakeClock()
        async with engine(echo_kept_alive) as (url, accepted):
            upstreams = Upstreams(connect_timeout=5, idle_timeout=4, clock=clock)
            for step in (1.0, 3.9, 4.0):
                clock.now += step
                got = await upstreams.post(url, "/", b"x", [])
                assert await got.read() == b"X"
                got.release()
            # 1 s and 3.9 s idle reuse the first connection; 4 s idle does not
            assert accepted == [0, 1]

    run(test())


def test_closing_an_answer_midway_closes_the_connection_for_the_engine() -> None:
    engine_saw_close = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\nmore\r\n")
        await writer.drain()
        assert await reader.read() == b""
        engine_saw_close.set()

    async def test() -> None:
        async with engine(endless) as (url, accepted):
            upstreams = Upstreams(connect_timeout=5)
            got = await upstreams.post(url, "/", b"{}", [])
            assert await got.read() == b"more"
            got.close()
            await asyncio.wait_for(engine_saw_close.wait(), 10)
            got.release()  # after close: nothing goes back to the pool
            assert upstreams._take_idle(upstreams._address(url)) is None
            assert accepted == [0]

    run(test())
