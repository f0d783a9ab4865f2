"""Front-end latency under abuse (issue #18): /health while 1 MB prompts arrive, 503s in a burst.

    python benchmarks/frontend.py [--model PATH] [--out frontend.json]

Starts `infer8 serve` on 127.0.0.1 (the default model unless --model), then, from this process
(the load generator is not the server's process):
1. health: 4 client processes post 1 MB prompts in a loop (each is tokenized, then refused as too long)
   while /health is polled every 20 ms for 10 s; prints the /health latency percentiles.
2. burst: 400 connections opened first, then 400 completion requests written at once to a server
   with --max-num-seqs 16 --max-waiting-requests 32; prints the time to each 503.
3. floor: the same two measurements against a bare asyncio server in its own process that
   answers every request at once (no parsing, no engine): what the clients and the machine
   cost by themselves. On a 2-core machine shared by the server, 4 flood processes and the
   measuring client, that floor is most of what step 1 and 2 report.

--client-nice N runs every load-generating process at nice N, as if the clients had their own
machine (the server keeps the CPU when both want it).

--abuse adds, per request that once stalled the server (a 15 MB /tokenize prompt, 2,000,000
prompts, 500,000 messages, a JSON schema nested 50,000 levels), /health's latency while one
client process posts it in a loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, extra: list[str]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "infer8.cli", "serve"]
    argv += ([model] if model else []) + ["--host", "127.0.0.1", "--port", str(port)]
    argv += ["--uvicorn-log-level", "warning", *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.3)
    raise RuntimeError("server did not start")


def percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)

    def pct(p: float) -> float:
        return values[min(len(values) - 1, int(p / 100 * len(values)))]

    return {
        "n": len(values),
        "p50_ms": 1e3 * pct(50),
        "p99_ms": 1e3 * pct(99),
        "max_ms": 1e3 * values[-1],
        "mean_ms": 1e3 * statistics.fmean(values),
    }


def _flood(url: str, seconds: float) -> None:
    """Post 1 MB prompts in a loop for `seconds` (runs in its own process)."""
    prompt = ("The quick brown fox jumps over the lazy dog. " * 23000)[:1_000_000]
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    end = time.monotonic() + seconds
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < end:
            client.post(f"{url}/v1/completions", content=body, headers=headers)


ABUSE = {
    "tokenize_15mb": ("/tokenize", {"prompt": "ab " * 5_000_000}),
    "prompts_2m": ("/v1/completions", {"prompt": ["a"] * 2_000_000, "max_tokens": 1}),
    "messages_500k": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": ""}] * 500_000},
    ),
    "schema_depth_50k": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 1, "guided_json": '{"a":' * 50_000 + "1" + "}" * 50_000},
    ),
}


def _post_loop(url: str, path: str, body: bytes, seconds: float) -> None:
    """Post one body in a loop for `seconds` (runs in its own process); each must be a 4xx."""
    headers = {"Content-Type": "application/json"}
    end = time.monotonic() + seconds
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < end:
            status = client.post(f"{url}{path}", content=body, headers=headers).status_code
            assert 400 <= status < 500, status


def health_under_abuse(url: str, duration_s: float = 6.0) -> dict[str, dict[str, float]]:
    """Return /health's latency percentiles while each ABUSE body is posted in a loop."""
    results = {}
    ctx = multiprocessing.get_context("spawn")
    for name, (path, body) in ABUSE.items():
        raw = json.dumps(body).encode()
        poster = ctx.Process(target=_post_loop, args=(url, path, raw, duration_s + 1.0))
        poster.start()
        results[name] = _poll_health(url, duration_s, start_after_s=1.0)
        poster.join()
        assert poster.exitcode == 0, name
    return results


def _poll_health(url: str, duration_s: float, start_after_s: float) -> dict[str, float]:
    time.sleep(start_after_s)
    latencies = []
    with httpx.Client(timeout=10) as client:
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            start = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    return percentiles(latencies)


def health_under_big_prompts(url: str, duration_s: float = 10.0) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    floods = [ctx.Process(target=_flood, args=(url, duration_s + 2.0)) for _ in range(4)]
    for p in floods:
        p.start()
    result = _poll_health(url, duration_s, start_after_s=2.0)
    for p in floods:
        p.join()
    return result


async def _burst(host: str, port: int, num: int) -> tuple[list[float], dict[int, int]]:
    body = json.dumps({"prompt": "Hello", "max_tokens": 64, "ignore_eos": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    conns = [await asyncio.open_connection(host, port) for _ in range(num)]
    times_503: list[float] = []
    statuses: dict[int, int] = {}

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        start = time.perf_counter()
        writer.write(head + body)
        await writer.drain()
        status_line = await reader.readline()
        elapsed = time.perf_counter() - start
        status = int(status_line.split()[1])
        statuses[status] = statuses.get(status, 0) + 1
        if status == 503:
            times_503.append(elapsed)
        await reader.read()
        writer.close()

    await asyncio.gather(*(one(r, w) for r, w in conns))
    return times_503, statuses


def overload_burst(port: int, num: int = 400) -> dict[str, object]:
    times_503, statuses = asyncio.run(_burst("127.0.0.1", port, num))
    return {**percentiles(times_503), "statuses": statuses}


_BARE_SERVER = """
import asyncio, sys
RESPONSE = (b"HTTP/1.1 503 Service Unavailable\\r\\ncontent-type: application/json\\r\\n"
            b"content-length: 2\\r\\nconnection: close\\r\\n\\r\\n{}")
HEALTH = (b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\n"
          b"content-length: 2\\r\\n\\r\\n{}")
async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\\r\\n\\r\\n")
            length = 0
            for line in head.split(b"\\r\\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            if head.startswith(b"GET /health"):
                writer.write(HEALTH)
                await writer.drain()
            else:
                writer.write(RESPONSE)
                await writer.drain()
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), backlog=1024)
    await server.serve_forever()
asyncio.run(main())
"""


def bare_server(port: int) -> subprocess.Popen[bytes]:
    """Start a server that answers at once (the floor of the measurement)."""
    proc = subprocess.Popen([sys.executable, "-c", _BARE_SERVER, str(port)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the bare server did not start")


def _report(results: dict[str, object], out: str | None) -> None:
    """Print the results (and write them to `out`), then exit at once."""
    print(json.dumps(results, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--client-nice", type=int, default=0, help="nice of the load generators")
    parser.add_argument("--abuse", action="store_true", help="also /health under ABUSE bodies")
    parser.add_argument("--abuse-only", action="store_true", help="only the ABUSE measurements")
    args = parser.parse_args()
    if args.abuse_only:
        port = _free_port()
        server = start_server(args.model, port, ["--kv-cache-memory-bytes", str(256 << 20)])
        try:
            os.nice(args.client_nice)
            results = {"health_under_abuse": health_under_abuse(f"http://127.0.0.1:{port}")}
        finally:
            server.terminate()
            server.wait()
        _report(results, args.out)
    results: dict[str, object] = {"client_nice": args.client_nice}
    # Every server starts first, at this process's priority; then the load generators (this
    # process and the flood processes it spawns) drop to --client-nice.
    ports = [_free_port() for _ in range(3)]
    kv = ["--kv-cache-memory-bytes", str(256 << 20)]
    servers = [
        start_server(args.model, ports[0], kv),
        start_server(
            args.model, ports[1], [*kv, "--max-num-seqs", "16", "--max-waiting-requests", "32"]
        ),
        bare_server(ports[2]),
    ]
    try:
        os.nice(args.client_nice)
        results["health_under_1mb_prompts"] = health_under_big_prompts(
            f"http://127.0.0.1:{ports[0]}"
        )
        results["time_to_503_in_400_burst"] = overload_burst(ports[1])
        if args.abuse:
            results["health_under_abuse"] = health_under_abuse(f"http://127.0.0.1:{ports[0]}")
        results["floor_health_under_1mb_prompts"] = health_under_big_prompts(
            f"http://127.0.0.1:{ports[2]}"
        )
        results["floor_time_to_503_in_400_burst"] = overload_burst(ports[2])
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait()
    _report(results, args.out)


if __name__ == "__main__":
    main()
