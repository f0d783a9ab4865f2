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

--empty-lists: /health (a new connection per probe, as a kubelet's) while 2 client processes
post `{"prompt": [[], [], ...]}` with 1,570,000 empty lists (4.7 MB, under the default cap)
in a loop for 10 s.
--stalled-bodies: /health while one process holds 4,100 connections that each sent the head
of a 100-byte POST and 1 byte of it (a socket the server closes is opened again, 0.1 s
after a 503) for 25 s,
then closes all it holds at once; /health is polled 5 s more. Reports the probes' statuses,
the answers the stalled sockets got, and the bytes and tracebacks the server logged.
--costly-inputs: /health (a new connection per probe) while one client process posts, in a
loop for 8 s each, a grammar or template that once cost seconds to minutes before its 400: a
guided_regex of 100,000 alternations, 60,000 guided_choice entries, 10,000 tools with
tool_choice "required", a regex whose compile runs past the time limit, and a chat request
to a server started with --chat-template of two nested 100,000-step loops.
Each of these runs alone (with none, the default measurements run).
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


def start_server(
    model: str | None, port: int, extra: list[str], log_path: str | None = None
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "infer8.cli", "serve"]
    argv += ([model] if model else []) + ["--host", "127.0.0.1", "--port", str(port)]
    argv += ["--uvicorn-log-level", "warning", *extra]
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(argv, stdout=log, stderr=log)
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


EMPTY_LISTS_BODY = b'{"prompt":[' + b",".join([b"[]"] * 1_570_000) + b"]}"


def health_under_empty_lists(url: str, duration_s: float = 10.0) -> dict[str, object]:
    """Return /health's latency and statuses while 2 processes post EMPTY_LISTS_BODY."""
    ctx = multiprocessing.get_context("spawn")
    args = (url, "/v1/completions", EMPTY_LISTS_BODY, duration_s + 1.0)
    posters = [ctx.Process(target=_post_loop, args=args) for _ in range(2)]
    for p in posters:
        p.start()
    time.sleep(1.0)
    result = _probe_health(url, time.monotonic() + duration_s)
    for p in posters:
        p.join()
        assert p.exitcode == 0
    return result


def _probe_health(url: str, end: float) -> dict[str, object]:
    """Probe /health every 20 ms until `end` (monotonic), a new connection each, as a kubelet."""
    host, port = url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    latencies, statuses = [], {}
    while time.monotonic() < end:
        start = time.perf_counter()
        try:
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(request)
                response = b""
                while chunk := sock.recv(65536):
                    response += chunk
            status = response[9:12].decode("latin-1") or "closed"
        except OSError as e:
            status = type(e).__name__
        latencies.append(time.perf_counter() - start)
        statuses[status] = statuses.get(status, 0) + 1
        time.sleep(0.02)
    return {**percentiles(latencies), "statuses": statuses}


STALLED_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n{"
)


async def _hold_stalled(port: int, num_sockets: int, end: float) -> dict[str, object]:
    answers: dict[str, int] = {}
    lifetimes: list[float] = []
    held: list[asyncio.StreamWriter] = []

    async def one() -> None:
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            opened = time.monotonic()
            writer.write(STALLED_HEAD)
            held.append(writer)
            try:
                line = await asyncio.wait_for(reader.read(12), max(0.0, end - opened))
            except (TimeoutError, OSError):
                return  # still open at the end (or reset): closed with the others below
            held.remove(writer)
            lifetimes.append(time.monotonic() - opened)
            answer = line.decode("latin-1")[9:12] if line else "closed"
            answers[answer] = answers.get(answer, 0) + 1
            writer.close()
            if answer == "503":  # the server is full: retry soon, not in a tight loop
                await asyncio.sleep(0.1)

    await asyncio.gather(*(one() for _ in range(num_sockets)))
    for writer in held:  # all at once
        writer.transport.abort()
    return {
        "answers": answers,
        "num_open_at_end": len(held),
        "max_lifetime_s": max(lifetimes, default=0.0),
    }


def _stalled_process(port: int, num_sockets: int, end: float, queue: multiprocessing.Queue) -> None:
    queue.put(asyncio.run(_hold_stalled(port, num_sockets, end)))


def health_under_stalled_bodies(
    model: str | None, num_sockets: int = 4100, hold_s: float = 25.0, after_s: float = 5.0
) -> dict[str, object]:
    """Return /health while num_sockets stall their bodies, and after they all close at once."""
    port = _free_port()
    log_path = f"/tmp/frontend-stalled-{port}.log"
    kv = ["--kv-cache-memory-bytes", str(256 << 20)]
    server = start_server(model, port, kv, log_path=log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        end = time.monotonic() + 2.0 + hold_s
        holder = ctx.Process(target=_stalled_process, args=(port, num_sockets, end, queue))
        holder.start()
        time.sleep(2.0)  # the sockets connect
        during = _probe_health(url, end)
        after = _probe_health(url, end + after_s)
        sockets = queue.get(timeout=60)
        holder.join()
    finally:
        server.terminate()
        server.wait()
    with open(log_path, "rb") as f:
        log = f.read()
    return {
        "health_while_held": during,
        "health_after_closing_all": after,
        "stalled_sockets": sockets,
        "server_log_bytes": len(log),
        "server_log_tracebacks": log.count(b"Traceback"),
    }


RUNAWAY_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
)
_HI = [{"role": "user", "content": "hi"}]
_TOOLS = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(10_000)]
COSTLY = {
    "regex_100k_alternations": (
        "/v1/completions",
        {
            "prompt": "hi",
            "max_tokens": 1,
            "guided_regex": "|".join(f"w{i}" for i in range(100_000)),
        },
    ),
    "choice_60k": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 1, "guided_choice": [f"c{i}" for i in range(60_000)]},
    ),
    "tools_10k_required": (
        "/v1/chat/completions",
        {"messages": _HI, "max_tokens": 1, "tools": _TOOLS, "tool_choice": "required"},
    ),
    # 400 characters that take seconds to compile: only the compile's time limit stops it.
    "regex_past_the_time_limit": (
        "/v1/completions",
        {
            "prompt": "hi",
            "max_tokens": 1,
            "guided_regex": "".join(f".{{0,{1000 + i}}}{chr(97 + i % 26)}" for i in range(40)),
        },
    ),
    "runaway_chat_template": ("/v1/chat/completions", {"messages": _HI, "max_tokens": 1}),
}


def health_under_costly_inputs(model: str | None, duration_s: float = 8.0) -> dict[str, object]:
    """Return /health's latency and statuses while each COSTLY body is posted in a loop, and
    how many 400s the poster got, on a server whose chat template runs away."""
    port = _free_port()
    extra = ["--kv-cache-memory-bytes", str(256 << 20), "--chat-template", RUNAWAY_TEMPLATE]
    server = start_server(model, port, extra)
    url = f"http://127.0.0.1:{port}"
    results: dict[str, object] = {}
    ctx = multiprocessing.get_context("spawn")
    try:
        for name, (path, body) in COSTLY.items():
            raw = json.dumps(body).encode()
            queue = ctx.Queue()
            poster = ctx.Process(target=_count_loop, args=(url, path, raw, duration_s + 1.0, queue))
            poster.start()
            time.sleep(1.0)
            results[name] = {
                **_probe_health(url, time.monotonic() + duration_s),
                "answers": queue.get(timeout=120),
            }
            poster.join()
    finally:
        server.terminate()
        server.wait()
    return results


def _count_loop(
    url: str, path: str, body: bytes, seconds: float, queue: multiprocessing.Queue
) -> None:
    """Post one body in a loop for `seconds` and put {status: count} on the queue."""
    headers = {"Content-Type": "application/json"}
    end = time.monotonic() + seconds
    answers: dict[int, int] = {}
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < end:
            status = client.post(f"{url}{path}", content=body, headers=headers).status_code
            answers[status] = answers.get(status, 0) + 1
    queue.put(answers)


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
    parser.add_argument("--empty-lists", action="store_true", help="only /health under [] x 1.57M")
    parser.add_argument(
        "--stalled-bodies", action="store_true", help="only /health under 4,100 stalled bodies"
    )
    parser.add_argument(
        "--costly-inputs", action="store_true", help="only /health under costly grammars/templates"
    )
    args = parser.parse_args()
    if args.empty_lists or args.stalled_bodies or args.costly_inputs:
        results: dict[str, object] = {"load_average": os.getloadavg()}
        if args.empty_lists:
            port = _free_port()
            server = start_server(args.model, port, ["--kv-cache-memory-bytes", str(256 << 20)])
            try:
                results["health_under_empty_lists"] = health_under_empty_lists(
                    f"http://127.0.0.1:{port}"
                )
            finally:
                server.terminate()
                server.wait()
        if args.stalled_bodies:
            results["stalled_bodies"] = health_under_stalled_bodies(args.model)
        if args.costly_inputs:
            results["costly_inputs"] = health_under_costly_inputs(args.model)
        _report(results, args.out)
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
    results = {"client_nice": args.client_nice}
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
