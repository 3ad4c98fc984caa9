"""The generation benchmark's transformers baseline gets exactly rollbus's prompts."""

from __future__ import annotations

from tests.bench import generation, hf_generate


def test_transformers_baseline_gets_the_same_prompts_as_rollbus() -> None:
    batch, vocab = 16, generation.MODEL["vocab_size"]
    hf = hf_generate.prompts(batch, generation.PROMPT_LEN, vocab)
    ours = [generation._body(i, False)["prompt"] for i in range(batch)]
    assert hf == ours
    assert all(len(p) == generation.PROMPT_LEN for p in hf)
    assert len({tuple(p) for p in hf}) == batch  # 16 different prompts, not one repeated


def test_the_bare_http_client_sends_the_bench_requests_and_counts_the_tokens() -> None:
    """The bench's minimal-client row must be the httpx row's requests (same route, same
    bodies), or it would not show httpx's share."""
    import asyncio
    import json

    seen: list[tuple[bytes, dict[str, object]]] = []

    async def main() -> float:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            head = await r.readuntil(b"\r\n\r\n")
            size = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            seen.append((head.split(b"\r\n")[0], json.loads(await r.readexactly(size))))
            body = json.dumps({"usage": {"completion_tokens": 3}}).encode()
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await w.drain()
            w.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await generation.via_raw_http(f"http://127.0.0.1:{port}", 4)

    assert asyncio.run(main()) > 0
    assert {line for line, _ in seen} == {b"POST /v1/completions HTTP/1.1"}
    bodies = sorted((b for _, b in seen), key=json.dumps)
    assert bodies == sorted((generation._body(i, False) for i in range(4)), key=json.dumps)
