#!/usr/bin/env python3
"""dalle-serve under load, and its throughput against dalle-generate (docs/serve.md, "Load").

Usage (with the project's venv python, ~/.cache/dalle/venv/bin/python; standard library only):
  serve_load.py load  [--quick] [--clients 32] [--requests 20] [--max-queue 16] [--model DIR]
  serve_load.py bench [--levels 1,4,16] [--images 32] [--candidates 2] [--config FILE]
  serve_load.py slow  [--stalled 1000] [--idle 1000] [--model DIR]
  serve_load.py memory [--budget-mib 1024] [--side 5700] [--half-bodies 200] [--jobs 64] [--mixed 64]
Both take --source (the checkout; default this script's parent's parent) and --tools (the
built dalle-serve and dalle-generate; default SOURCE/build/tools).

load: starts dalle-serve on a free port of 127.0.0.1 and lets CLIENTS threads send REQUESTS
  requests each, all at once (n=1, one candidate, no super-resolution; every other one by URL,
  whose PNG is then fetched). Every request must be answered 200 with its image or refused
  429 with OpenAI's rate_limit_exceeded and Retry-After (a refused client waits 50 ms and
  goes on); anything else (another status, a dropped connection, a timeout) is counted as
  lost and fails the run. The server's own /metrics must count the same 200s and 429s, it
  must still answer /health, and its RSS (/proc/PID/status, VmRSS) after the loop may exceed
  the RSS after a warm-up round (every client once) by at most --max-rss-growth-mib. Then
  SIGTERM must drain it to exit status 0. Prints one JSON line; exit status 1 on a failure.
  --quick (the ctest version): 32 clients x 2 requests with a two-place queue, and at least
  one 429 is required (the queue must have been full at least once).

bench: images/s and p50/p99 latency of fixed requests (n=1, --candidates candidates, no
  super-resolution) at each level of concurrent clients, --images requests per level, against
  one dalle-generate call drawing as many images with the same settings (as many prompts,
  --candidates CANDIDATES -n 1). dalle-generate's time is its pipeline call alone (from its last
  "generate:" progress line: tokens drawn / rate), so that neither side counts loading the
  models; its wall time is given too. Prints a JSON line per level, one for dalle-generate, and
  a summary with the ratio at the highest level. Meant for a quiet machine (it reports the
  load average before and after); it asserts nothing (docs/benchmarks.md). Each level also
  gives the server's own p50 arrival-to-answer time (from its log; the clients' p50 minus it
  is what HTTP costs) and the fraction of the wall time its worker spent in generate calls.

slow: slow and idle clients must not stop the service. Measures a generation request's
  latency (the median of 3) and /health's on a quiet server, then opens STALLED connections
  that send half a request line and stall, and IDLE keep-alive connections that were
  answered once and stay open; with all of them open, /health must answer within 1 s and a
  generation request within its quiet latency + 1 s, and the server's /metrics must count
  the connections open that the clients hold. Connections beyond max_connections (set to
  the clients' count + 8) must be closed at once and counted refused, and after
  header_timeout_seconds the server must have closed every stalled and idle connection and
  counted them timed out. The server's RSS before and after opening them gives its memory
  per idle connection. Prints one JSON line; exit status 1 on a failure.

memory: no upload, body, job or mix of requests grows the server past its memory budget
  (max_memory_megabytes = --budget-mib). After a warm-up at the largest batch the server runs
  (64 candidates, super-resolution on), the server's RSS is the start (the models with their
  working memory, which the budget leaves aside); then
  four phases, each all at once: 12 edits of a SIDE x SIDE PNG (the largest legal image at
  5700), --half-bodies connections each mid-way through a 4 MB body, the job store filled with
  --jobs finished jobs, and --mixed generations of their own temperatures, guidance and
  adapters (two random adapters loaded with --adapter NAME=FILE, chosen in five ways). A
  thread samples the RSS and /health's latency every 0.1 s. Every request must be answered
  (200, or a status with OpenAI's error code: 503 memory_budget_exceeded, 429...), the RSS of
  every phase must stay under the start plus the budget, and /health must answer within 1 s
  throughout. Prints one JSON line; exit status 1 on a failure.
"""
import argparse
import base64
import http.client
import json
import math
import os
import pathlib
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
from serve_process import ServeProcess, write_random_adapter  # noqa: E402

PROMPTS = ["a red sandal on the right", "a blue bag on the left", "a white sneaker at the top",
           "a green shirt at the bottom", "a yellow trouser on the left and a red bag on the right",
           "a cyan sandal at the top", "a magenta dress on the right", "a white coat on the left"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fail(message):
    print(f"serve_load: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def percentile(values, p):
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def on_threads(clients, client):
    """Runs client(0) .. client(clients - 1) on threads of their own; the seconds until all are done."""
    threads = [threading.Thread(target=client, args=(index,)) for index in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - started


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class Server(ServeProcess):
    """dalle-serve run in the checkout (a config's paths are relative to it)."""

    def __init__(self, tools, source, arguments, start_timeout=180):
        try:
            super().__init__(tools, arguments, cwd=source, start_timeout=start_timeout)
        except RuntimeError as error:
            fail(str(error))

    def request(self, method, path, body=None, timeout=300):
        """(status, headers, body bytes) of one call on a connection of its own."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            headers = {"Connection": "close"}
            if body is not None:
                headers["Content-Type"] = "application/json"
                body = json.dumps(body).encode()
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.headers, response.read()
        finally:
            connection.close()


def served_counts(server):
    """{status: count} of POST /v1/images/generations answers, from /metrics."""
    status, _, text = server.request("GET", "/metrics", timeout=30)
    if status != 200:
        fail(f"/metrics answered {status}")
    counts = {}
    for match in re.finditer(r'^dalle_http_requests_total\{endpoint="/v1/images/generations",status="(\d+)"\} (\d+)',
                             text.decode(), re.MULTILINE):
        counts[int(match.group(1))] = int(match.group(2))
    return counts


# ---- load ----------------------------------------------------------------------------------------

class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.ok = self.refused = 0
        self.lost = []  # (what, detail) of every request answered otherwise or not at all
        self.latencies = []

    def add(self, outcome, latency=None, detail=""):
        with self.lock:
            if outcome == "ok":
                self.ok += 1
                self.latencies.append(latency)
            elif outcome == "refused":
                self.refused += 1
            else:
                self.lost.append(f"{outcome}: {detail}"[:300])


def one_request(server, body, timeout):
    """'ok', 'refused', or ('lost' reason, detail), with the latency of an answered request."""
    started = time.monotonic()
    try:
        status, headers, payload = server.request("POST", "/v1/images/generations", body, timeout)
        if status == 429:
            error = json.loads(payload).get("error", {})
            if error.get("code") != "rate_limit_exceeded" or headers.get("Retry-After") != "1":
                return "malformed 429", f"{headers.get('Retry-After')} {payload[:200]!r}", None
            return "refused", "", None
        if status != 200:
            return f"status {status}", payload[:200], None
        data = json.loads(payload)["data"]
        if len(data) != body["n"]:
            return "wrong count", f"{len(data)} images for n={body['n']}", None
        if body["response_format"] == "url":
            path = data[0]["url"].split(f":{server.port}", 1)[1]
            status, headers, png = server.request("GET", path, timeout=timeout)
            if status != 200:
                return f"image URL status {status}", path, None
        else:
            png = base64.b64decode(data[0]["b64_json"])
        if not png.startswith(PNG_SIGNATURE):
            return "not a PNG", png[:16], None
        return "ok", "", time.monotonic() - started
    except Exception as error:  # a dropped connection or a timeout: the request is lost
        return f"exception {type(error).__name__}", str(error), None


def run_clients(server, clients, requests, tally, seed_base, timeout, backoff=0.05):
    barrier = threading.Barrier(clients)

    def client(index):
        barrier.wait()
        for number in range(requests):
            seed = seed_base + index * requests + number
            body = {"prompt": PROMPTS[seed % len(PROMPTS)], "n": 1, "candidates": 1, "superres": False,
                    "seed": seed, "response_format": "url" if seed % 2 else "b64_json"}
            outcome, detail, latency = one_request(server, body, timeout)
            tally.add(outcome, latency, detail)
            if outcome == "refused":
                time.sleep(backoff)

    return on_threads(clients, client)


def load(args):
    source, tools = args.source, args.tools
    if args.quick:
        args.clients, args.requests, args.max_queue = 32, 2, 2
        args.deadline = min(args.deadline, 240)
    signal.signal(signal.SIGALRM, lambda *_: fail(f"the run took over {args.deadline} s: a server or client hung"))
    signal.alarm(args.deadline)
    server_arguments = ["--model", args.model, "--threads", args.threads, "--set", f"max_queue={args.max_queue}",
                        "--set", f"batch_window_ms={args.batch_window_ms}"]
    with Server(tools, source, server_arguments) as server:
        pid = server.process.pid
        loaded = rss_mib(pid)
        # Warm-up: every client once, so that torch's buffers and every connection thread's
        # allocations exist before the RSS the loop is measured against.
        warmup = Tally()
        run_clients(server, args.clients, 1, warmup, 10**6, args.request_timeout)
        before = rss_mib(pid)
        tally = Tally()
        # RSS every 0.1 s during the loop: its peak, and where it stood when half the requests
        # were answered (a leak keeps growing through the second half; warming up does not).
        samples, done = [], threading.Event()

        def sample_rss():
            while not done.wait(0.1):
                try:
                    samples.append((tally.ok + tally.refused + len(tally.lost), rss_mib(pid)))
                except (OSError, RuntimeError):
                    return

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        seconds = run_clients(server, args.clients, args.requests, tally, 0, args.request_timeout)
        done.set()
        sampler.join()
        after = rss_mib(pid)
        half = next((rss for answered, rss in samples if answered >= args.clients * args.requests / 2), after)
        peak = max([after] + [rss for _, rss in samples])
        alive = server.process.poll() is None
        health_status, _, health = server.request("GET", "/health", timeout=30) if alive else (None, None, b"")
        health = json.loads(health) if health_status == 200 else health.decode(errors="replace")
        counted = served_counts(server) if alive else {}
        if alive:
            server.process.send_signal(signal.SIGTERM)
        try:
            exit_code = server.process.wait(120)
        except subprocess.TimeoutExpired:
            exit_code = None
    total = args.clients * args.requests
    expected = {200: tally.ok + warmup.ok, 429: tally.refused + warmup.refused}
    result = {
        "test": "serve_load", "model": pathlib.Path(args.model).name, "clients": args.clients,
        "requests_per_client": args.requests, "max_queue": args.max_queue, "requests": total,
        "ok": tally.ok, "refused_429": tally.refused, "lost": len(tally.lost),
        "warmup": {"requests": args.clients, "ok": warmup.ok, "refused_429": warmup.refused,
                   "lost": len(warmup.lost)},
        "seconds": round(seconds, 2), "images_per_second": round(tally.ok / seconds, 3),
        "latency_p50_s": round(percentile(tally.latencies, 50), 3) if tally.latencies else None,
        "latency_p99_s": round(percentile(tally.latencies, 99), 3) if tally.latencies else None,
        "rss_mib": {"loaded": round(loaded, 1), "after_warmup": round(before, 1), "at_half": round(half, 1),
                    "after_loop": round(after, 1), "peak_during_loop": round(peak, 1)},
        "rss_growth_mib": round(after - before, 1), "max_rss_growth_mib": args.max_rss_growth_mib,
        "server_counted": {str(status): count for status, count in sorted(counted.items())},
        "health_after": health.get("status") if isinstance(health, dict) else health,
        "exit_status_after_sigterm": exit_code,
    }
    problems = []
    if tally.lost or warmup.lost:
        problems.append(f"{len(tally.lost) + len(warmup.lost)} requests lost: {(warmup.lost + tally.lost)[:5]}")
    if tally.ok + tally.refused != total:
        problems.append(f"{tally.ok} + {tally.refused} answers for {total} requests")
    if not alive:
        problems.append(f"the server died during the loop (exit {server.process.returncode})")
    if health_status != 200 or not isinstance(health, dict) or health.get("status") != "ok":
        problems.append(f"/health after the loop: {health_status} {health}")
    if counted and {status: counted.get(status, 0) for status in (200, 429)} != expected:
        problems.append(f"the server counted {counted}, the clients {expected}")
    if set(counted) - {200, 429}:
        problems.append(f"the server answered other statuses: {counted}")
    if after - before > args.max_rss_growth_mib:
        problems.append(f"RSS grew by {after - before:.1f} MiB over the loop (bound {args.max_rss_growth_mib})")
    if exit_code != 0:
        problems.append(f"exit status {exit_code} after SIGTERM")
    if args.quick and tally.refused + warmup.refused == 0:
        problems.append("no request was refused with 429: the two-place queue was never full")
    result["passed"] = not problems
    print(json.dumps(result), flush=True)
    if problems:
        fail("; ".join(problems) + "\n--- server log (tail) ---\n" + "".join(server.lines[-30:]))


# ---- bench ---------------------------------------------------------------------------------------

def bench_level(server, clients, images, candidates, timeout):
    """One level: `images` requests spread over `clients` clients started together."""
    per_client = images // clients
    latencies, problems, lock = [], [], threading.Lock()
    barrier = threading.Barrier(clients)

    def client(index):
        barrier.wait()
        for number in range(per_client):
            seed = index * per_client + number
            body = {"prompt": PROMPTS[seed % len(PROMPTS)], "n": 1, "candidates": candidates, "superres": False,
                    "seed": seed, "response_format": "b64_json"}
            started = time.monotonic()
            status, _, payload = server.request("POST", "/v1/images/generations", body, timeout)
            with lock:
                (latencies.append(time.monotonic() - started) if status == 200
                 else problems.append(f"{status} {payload[:200]!r}"))

    logged_before = len(server.lines)
    seconds = on_threads(clients, client)
    if problems:
        fail(f"{clients} clients: {len(problems)} requests failed: {problems[:3]}")
    time.sleep(0.1)  # the last answers' log lines
    # The server's own account of each request: arrival to answer, and its generate call's
    # time shared among the requests in it; the rest of the wall time the worker was idle.
    answered = [re.search(r"images for .* in ([0-9.e-]+) s \(generated with (\d+) other requests in ([0-9.e-]+) s",
                          line) for line in server.lines[logged_before:]]
    answered = [match for match in answered if match]
    served = [float(match.group(1)) for match in answered]
    generating = sum(float(match.group(3)) / (int(match.group(2)) + 1) for match in answered)
    return {"bench": "serve", "clients": clients, "images": clients * per_client, "seconds": round(seconds, 2),
            "images_per_second": round(clients * per_client / seconds, 3),
            "latency_p50_s": round(percentile(latencies, 50), 2), "latency_p99_s": round(percentile(latencies, 99), 2),
            "server_latency_p50_s": round(percentile(served, 50), 3) if served else None,
            "worker_generating_fraction": round(generating / seconds, 3)}


def generate_baseline(args, images, scratch):
    """One dalle-generate call drawing `images` images with the requests' settings."""
    prompts = scratch / "prompts.txt"
    prompts.write_text("".join(PROMPTS[i % len(PROMPTS)] + "\n" for i in range(images)))
    model = ["--model", args.model] if args.model else ["--config", args.generate_config]
    command = [str(args.tools / "dalle-generate"), *model, "--out", str(scratch / "out"), "--prompts-file", str(prompts),
               "--candidates", str(args.candidates), "-n", "1", "--seed", "0", "--threads", str(args.threads),
               "--set", f"batch_size={args.batch_size}", "--set", 'superres=""', "--log-level", "info"]
    started = time.monotonic()
    result = subprocess.run(command, cwd=args.source, capture_output=True, text=True, timeout=args.deadline)
    wall = time.monotonic() - started
    if result.returncode != 0:
        fail(f"dalle-generate failed: {' '.join(command)}\n{result.stdout}{result.stderr}")
    # The pipeline call alone, as on the server's side: the last progress line of the
    # "generate" stage says how many tokens were drawn and at what rate.
    lines = re.findall(r"\] generate: (\d+)/\d+ \(100\.0%\) ([0-9.]+) it/s", result.stdout + result.stderr)
    if not lines:
        fail(f"no final progress line in dalle-generate's log:\n{result.stdout}{result.stderr}")
    tokens, rate = lines[-1]
    generate_seconds = int(tokens) / float(rate)
    return {"bench": "dalle-generate", "images": images, "candidates": args.candidates, "wall_seconds": round(wall, 2),
            "generate_seconds": round(generate_seconds, 2), "images_per_second": round(images / generate_seconds, 3),
            "images_per_second_wall": round(images / wall, 3)}


def bench(args):
    signal.signal(signal.SIGALRM, lambda *_: fail(f"the benchmark took over {args.deadline} s"))
    signal.alarm(args.deadline)
    levels = [int(level) for level in args.levels.split(",")]
    for level in levels:
        if args.images % level:
            fail(f"--images {args.images} is not a multiple of {level} clients")
    with open("/proc/loadavg") as loadavg:
        load_before = float(loadavg.read().split()[0])
    lines = []
    model = ["--model", args.model] if args.model else ["--config", args.config]
    server_arguments = [*model, "--threads", args.threads, "--set", f"max_queue={max(levels)}",
                        "--set", f"pipeline.batch_size={args.batch_size}"]
    with Server(args.tools, args.source, server_arguments) as server:
        if server.request("POST", "/v1/images/generations", {"prompt": PROMPTS[0], "candidates": args.candidates,
                                                             "superres": False})[0] != 200:
            fail("the warm-up request failed")
        for level in levels:
            line = bench_level(server, level, args.images, args.candidates, args.request_timeout)
            line["candidates"] = args.candidates
            print(json.dumps(line), flush=True)
            lines.append(line)
    with tempfile.TemporaryDirectory() as scratch:
        baseline = generate_baseline(args, args.images, pathlib.Path(scratch))
    print(json.dumps(baseline), flush=True)
    with open("/proc/loadavg") as loadavg:
        load_after = float(loadavg.read().split()[0])
    top = lines[-1]
    ratio = top["images_per_second"] / baseline["images_per_second"]
    print(json.dumps({"bench": "serve-summary", "clients": top["clients"], "ratio_to_dalle_generate": round(ratio, 3),
                      "ratio_to_dalle_generate_wall": round(top["images_per_second"] / baseline["images_per_second_wall"], 3),
                      "target": 0.8, "met": ratio >= 0.8, "threads": args.threads, "batch_size": args.batch_size,
                      "loadavg_1min": {"before": load_before, "after": load_after}}), flush=True)

# ---- slow ----------------------------------------------------------------------------------------

def metric(server, name):
    status, _, text = server.request("GET", "/metrics", timeout=30)
    match = re.search(rf"^{name} (\d+)", text.decode(), re.MULTILINE) if status == 200 else None
    if not match:
        fail(f"/metrics has no {name}")
    return int(match.group(1))


def timed(call):
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


def open_connections(port, count, first_bytes, read_answer):
    """`count` sockets to the server, each sent `first_bytes`; with read_answer, each reads one
    whole answer (a keep-alive one, which leaves the connection open)."""
    sockets = []
    for _ in range(count):
        connection = socket.create_connection(("127.0.0.1", port), timeout=30)
        connection.sendall(first_bytes)
        sockets.append(connection)
    if read_answer:
        for connection in sockets:
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                piece = connection.recv(65536)
                if not piece:
                    fail("an idle client's first answer was cut")
                answer += piece
    return sockets


def closed_by_server(connection, seconds):
    """Whether the server closed `connection` (its end: EOF or a reset) within `seconds`."""
    watch = select.poll()
    watch.register(connection, select.POLLIN)
    if not watch.poll(seconds * 1000):
        return False
    try:
        return connection.recv(65536) == b""
    except (ConnectionResetError, socket.timeout):
        return True


def closed_within(connections, seconds):
    """How many of `connections` the server closes within `seconds`, waiting on all at once."""
    watch, closed = select.poll(), 0
    by_descriptor = {connection.fileno(): connection for connection in connections}
    for descriptor in by_descriptor:
        watch.register(descriptor, select.POLLIN)
    deadline = time.monotonic() + seconds
    while by_descriptor and time.monotonic() < deadline:
        for descriptor, _ in watch.poll(max(0.0, deadline - time.monotonic()) * 1000):
            watch.unregister(descriptor)
            closed += closed_by_server(by_descriptor.pop(descriptor), 0)
    return closed


def report(result, problems, exit_code, server):
    """Prints the run's JSON line, passed or not; fails naming the problems, with the server's log."""
    if exit_code != 0:
        problems.append(f"exit status {exit_code} after SIGTERM")
    result["passed"] = not problems
    print(json.dumps(result), flush=True)
    if problems:
        fail("; ".join(problems) + "\n--- server log (tail) ---\n" + "".join(server.lines[-30:]))


def slow(args):
    signal.signal(signal.SIGALRM, lambda *_: fail(f"the run took over {args.deadline} s: a server or client hung"))
    signal.alarm(args.deadline)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = args.stalled + args.idle + 256
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    clients = args.stalled + args.idle
    # Long enough for the measurements with every connection open; then they must all go.
    header_timeout = args.header_timeout
    server_arguments = ["--model", args.model, "--threads", args.threads, "--set", "batch_window_ms=0",
                        "--set", f"max_connections={clients + 8}", "--set", f"max_connections_per_client={clients + 8}",
                        "--set", f"header_timeout_seconds={header_timeout}", "--set", f"idle_timeout_seconds={4 * header_timeout}"]
    body = {"prompt": PROMPTS[0], "n": 1, "candidates": 2, "superres": False, "response_format": "b64_json", "seed": 1}
    problems = []
    with Server(args.tools, args.source, server_arguments) as server:
        pid = server.process.pid
        server.request("POST", "/v1/images/generations", body)  # warm-up
        quiet = sorted(timed(lambda: server.request("POST", "/v1/images/generations", body))[1] for _ in range(3))[1]
        _, quiet_health = timed(lambda: server.request("GET", "/health", timeout=30))
        rss_before = rss_mib(pid)
        opened_at = time.monotonic()
        stalled = open_connections(server.port, args.stalled, b"POST /v1/images/gener", False)
        idle = open_connections(server.port, args.idle, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", True)
        open_seconds = time.monotonic() - opened_at
        rss_open = rss_mib(pid)
        (health_status, _, _), health_seconds = timed(lambda: server.request("GET", "/health", timeout=30))
        (status, _, _), loaded = timed(lambda: server.request("POST", "/v1/images/generations", body))
        counted_open = metric(server, "dalle_http_connections_open")
        # Over the cap: what the cap leaves (8 - the /metrics call's) plus 8 more must be refused.
        extra = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(16)]
        refused_at_once = closed_within(extra, 1.0)
        for connection in extra:
            connection.close()
        time.sleep(0.2)  # the server sees the admitted ones close, leaving room for /metrics
        refused = metric(server, "dalle_http_connections_refused_total")
        measured_within = time.monotonic() - opened_at
        # Past the header deadline, every stalled and idle connection is closed by the server.
        still_open = [connection for connection in stalled + idle
                      if not closed_by_server(connection, max(0.0, opened_at + header_timeout + 2 - time.monotonic()))]
        timed_out = metric(server, "dalle_http_connections_timed_out_total")
        open_after = metric(server, "dalle_http_connections_open")
        for connection in stalled + idle:
            connection.close()
        server.process.send_signal(signal.SIGTERM)
        exit_code = server.process.wait(120)
    result = {
        "test": "serve_slow_clients", "model": pathlib.Path(args.model).name, "stalled": args.stalled,
        "idle": args.idle, "seconds_to_open_them": round(open_seconds, 2),
        "quiet": {"generation_s": round(quiet, 3), "health_s": round(quiet_health, 4)},
        "with_them_open": {"health_status": health_status, "health_s": round(health_seconds, 4),
                           "generation_status": status, "generation_s": round(loaded, 3)},
        "server_counted_open": counted_open, "clients_open": clients + 1,
        "over_the_cap": {"tried": len(extra), "closed_at_once": refused_at_once, "server_counted_refused": refused},
        "rss_mib": {"before": round(rss_before, 1), "with_them_open": round(rss_open, 1)},
        "kib_per_idle_connection": round((rss_open - rss_before) * 1024 / clients, 1),
        "measured_within_s": round(measured_within, 2), "header_timeout_seconds": header_timeout,
        "still_open_after_deadline": len(still_open), "server_counted_timed_out": timed_out,
        "open_after_deadline": open_after, "exit_status_after_sigterm": exit_code,
    }
    if measured_within > header_timeout:
        problems.append(f"the measurements took {measured_within:.1f} s, past the {header_timeout} s header deadline: "
                        "raise --header-timeout")
    if health_status != 200 or health_seconds > 1.0:
        problems.append(f"/health answered {health_status} in {health_seconds:.2f} s with them open (bound 1 s)")
    if status != 200 or loaded > quiet + 1.0:
        problems.append(f"a generation answered {status} in {loaded:.2f} s with them open (quiet: {quiet:.2f} s + 1 s)")
    if counted_open != clients + 1:  # the /metrics call's own connection
        problems.append(f"the server counted {counted_open} connections open, the clients hold {clients + 1}")
    if refused_at_once < 8 or refused < 8:
        problems.append(f"over the cap: {refused_at_once} of 16 closed at once, {refused} counted refused (8 at least)")
    if still_open:
        problems.append(f"{len(still_open)} stalled or idle connections still open past the header deadline")
    if timed_out < clients:
        problems.append(f"the server counted {timed_out} timed out, {clients} were overdue")
    report(result, problems, exit_code, server)


def big_rgba_png(side, opaque_rows):
    """A side x side RGBA PNG (grey; its top `opaque_rows` rows opaque, the rest transparent: an
    edit's mask), made with zlib alone. Mostly one colour, so a legal pixel count in a small file."""
    import struct
    import zlib
    opaque = b"\x00" + b"\x80\x80\x80\xff" * side
    clear = b"\x00" + b"\x80\x80\x80\x00" * side
    packer = zlib.compressobj(9)
    data = b"".join(packer.compress(opaque if row < opaque_rows else clear) for row in range(side)) + packer.flush()

    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", side, side, 8, 6, 0, 0, 0)
    return PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def multipart(fields, files):
    boundary = "dalleloadboundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
             for name, value in fields.items()]
    for name, (filename, data) in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                     f"Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def post_raw(server, path, body, content_type, timeout):
    """(status, parsed JSON body or None) of one POST on a connection of its own; (None, why) when
    the connection failed."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": content_type, "Connection": "close"})
        response = connection.getresponse()
        payload = response.read()
        try:
            return response.status, json.loads(payload)
        except ValueError:
            return response.status, None
    except (OSError, http.client.HTTPException) as error:
        return None, str(error)
    finally:
        connection.close()


def outcome(status, body):
    """"200", or the status and OpenAI error code that name why a request was refused."""
    if status == 200 or status == 202:
        return str(status)
    code = body.get("error", {}).get("code") if isinstance(body, dict) else None
    return f"{status} {code}" if status else f"lost ({body})"


class Watch:
    """Samples the server's RSS and /health's latency every 0.1 s on a thread of its own."""

    def __init__(self, server):
        self.server, self.rss, self.health, self.failures = server, [], [], []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.done.wait(0.1):
            try:
                self.rss.append(rss_mib(self.server.process.pid))
                (status, _, _), seconds = timed(lambda: self.server.request("GET", "/health", timeout=30))
                self.health.append(seconds)
                if status != 200:
                    self.failures.append(status)
            except (OSError, RuntimeError, http.client.HTTPException) as error:
                self.failures.append(str(error))

    def phase(self):
        """The peak RSS and slowest /health since the last phase, and starts the next."""
        rss, health = max(self.rss, default=0), max(self.health, default=0)
        self.rss, self.health = [], []
        return round(rss, 1), round(health, 3)

    def stop(self):
        self.done.set()
        self.thread.join()


def memory(args):
    signal.signal(signal.SIGALRM, lambda *_: fail(f"the run took over {args.deadline} s: a server or client hung"))
    signal.alarm(args.deadline)
    budget_mib = args.budget_mib
    server_arguments = ["--model", args.model, "--threads", args.threads, "--set", "batch_window_ms=20",
                        "--set", f"max_memory_megabytes={budget_mib}", "--set", f"max_body_bytes={8 << 20}",
                        "--set", f"max_stored_jobs={args.jobs}", "--set", "max_queue=16",
                        "--set", "max_connections_per_client=1024"]
    image = big_rgba_png(args.side, args.side // 4)
    problems, phases = [], {}
    scratch = tempfile.TemporaryDirectory()
    prior = pathlib.Path(args.source) / args.model / "prior" / "model.safetensors"
    for name, seed in (("style_a", 5), ("style_b", 6)):
        adapter = write_random_adapter(prior, pathlib.Path(scratch.name) / f"{name}.safetensors", seed=seed)
        server_arguments += ["--adapter", f"{name}={adapter}"]
    with Server(args.tools, args.source, server_arguments) as server:
        pid = server.process.pid
        quick = {"n": 1, "candidates": 2, "superres": False, "response_format": "b64_json"}
        # Warm-up at the largest batch the server runs (the demo pipeline's batch_size, 64
        # candidates, super-resolution on): the start's RSS is the models with their working
        # memory, which the budget leaves aside.
        server.request("POST", "/v1/images/generations", {"prompt": PROMPTS[0], "n": 1, "candidates": 64,
                                                          "superres": True, "response_format": "b64_json"})
        started = rss_mib(pid)
        watch = Watch(server)

        def run(name, clients, call):
            outcomes = {}
            lock = threading.Lock()

            def client(index):
                result = call(index)
                with lock:
                    outcomes[result] = outcomes.get(result, 0) + 1

            seconds = on_threads(clients, client)
            rss, health = watch.phase()
            phases[name] = {"outcomes": outcomes, "seconds": round(seconds, 1), "peak_rss_mib": rss,
                            "slowest_health_s": health}
            lost = {key: count for key, count in outcomes.items() if key.startswith("lost")}
            if lost:
                problems.append(f"{name}: requests lost {lost}")

        # 1. Twelve edits at once of the largest legal image.
        form, kind = multipart({"prompt": PROMPTS[1], "n": "1", "candidates": "2", "superres": "false",
                                "response_format": "b64_json"}, {"image": ("big.png", image)})
        run("edits_of_the_largest_image", 12,
            lambda index: outcome(*post_raw(server, "/v1/images/edits", form, kind, args.request_timeout)))

        # 2. Connections held mid-way through a 4 MB body each.
        def half_body(sockets):
            connection = socket.create_connection(("127.0.0.1", server.port), timeout=60)
            connection.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                               b"\r\nContent-Length: " + str(4 << 20).encode() + b"\r\n\r\n" + b" " * (2 << 20))
            sockets.append(connection)
            return "held"

        held = []
        run("half_sent_4mb_bodies", args.half_bodies, lambda index: half_body(held))
        phases["half_sent_4mb_bodies"]["charged_mib"] = round(metric(server, "dalle_memory_charged_bytes") / 2**20, 1)
        for connection in held:
            connection.close()

        # 3. The job store filled with finished jobs.
        def job(index):
            fields = {"prompt": PROMPTS[index % len(PROMPTS)], "seed": index, **quick}
            while True:
                status, _, body = server.request("POST", "/v1/images/jobs", fields)
                if status != 429:
                    break
                time.sleep(0.2)
            if status != 202:
                return outcome(status, json.loads(body))
            job_id = json.loads(body)["id"]
            while True:
                status, _, body = server.request("GET", f"/v1/images/jobs/{job_id}")
                state = json.loads(body).get("status")
                if state not in ("queued", "in_progress"):
                    return f"job {state}"
                time.sleep(0.2)

        def jobs(index):
            ended = [job(index * 100 + k) for k in range(args.jobs // 16)]
            return next((state for state in ended if state != "job succeeded"), "job succeeded")

        run("job_store_filled", 16, jobs)

        # 4. Generations with settings and adapters of their own, all at once.
        adapter_choices = [{}, {"style_a": 1.0}, {"style_b": 0.5, "style_a": 1.0}, {"style_b": -0.5}, {"style_b": 1}]

        def mixed(index):
            fields = {"prompt": PROMPTS[index % len(PROMPTS)], "seed": index, "temperature": 0.5 + (index % 4) / 4,
                      "guidance_scale": float(index % 3), "adapters": adapter_choices[index % len(adapter_choices)],
                      **quick}
            status, _, body = server.request("POST", "/v1/images/generations", fields)
            return outcome(status, json.loads(body) if body.startswith(b"{") else None)

        run("mixed_generations", args.mixed, mixed)
        watch.stop()
        refusals = metric(server, "dalle_memory_refusals_total")
        server.process.send_signal(signal.SIGTERM)
        exit_code = server.process.wait(120)
    scratch.cleanup()
    bound = started + budget_mib
    result = {"test": "serve_memory", "model": pathlib.Path(args.model).name, "budget_mib": budget_mib,
              "rss_after_start_mib": round(started, 1), "bound_mib": round(bound, 1), "image_side": args.side,
              "image_png_bytes": len(image), "phases": phases, "budget_refusals": refusals,
              "health_failures": watch.failures[:5], "exit_status_after_sigterm": exit_code}
    for name, phase in phases.items():
        if phase["peak_rss_mib"] > bound:
            problems.append(f"{name}: RSS {phase['peak_rss_mib']} MiB over the start's plus the budget ({bound:.0f})")
        if phase["slowest_health_s"] > 1.0:
            problems.append(f"{name}: /health took {phase['slowest_health_s']} s (bound 1 s)")
    if watch.failures:
        problems.append(f"/health failed: {watch.failures[:3]}")
    report(result, problems, exit_code, server)


def main():
    here = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=pathlib.Path, default=here)
    parser.add_argument("--tools", type=pathlib.Path)
    parser.add_argument("--threads", default="1", help="torch threads of dalle-serve and dalle-generate")
    parser.add_argument("--request-timeout", type=float, default=300)
    commands = parser.add_subparsers(dest="mode", required=True)
    load_parser = commands.add_parser("load", help="concurrent clients against a small queue")
    load_parser.add_argument("--quick", action="store_true", help="32 clients x 2 requests, a two-place queue")
    load_parser.add_argument("--clients", type=int, default=32)
    load_parser.add_argument("--requests", type=int, default=20, help="requests per client")
    load_parser.add_argument("--max-queue", type=int, default=16)
    load_parser.add_argument("--batch-window-ms", type=int, default=20)
    load_parser.add_argument("--model", default="models/fashion-compose-f8", help="a model folder")
    load_parser.add_argument("--max-rss-growth-mib", type=float, default=64)
    load_parser.add_argument("--deadline", type=int, default=1200, help="seconds for the whole run")
    bench_parser = commands.add_parser("bench", help="images/s and latency against dalle-generate")
    bench_parser.add_argument("--levels", default="1,4,16", help="concurrent clients, comma-separated")
    bench_parser.add_argument("--images", type=int, default=32, help="requests (one image each) per level")
    bench_parser.add_argument("--candidates", type=int, default=2)
    bench_parser.add_argument("--batch-size", type=int, default=64, help="the pipeline's batch_size")
    bench_parser.add_argument("--config", default="configs/serve/fashion-compose.yaml",
                              help="dalle-serve's config (the demo models)")
    bench_parser.add_argument("--generate-config", default="configs/generate/fashion-compose-demo.yaml",
                              help="dalle-generate's config, the same pipeline")
    bench_parser.add_argument("--model", help="a model folder for both, in place of the two configs")
    bench_parser.add_argument("--deadline", type=int, default=1800, help="seconds for the whole run")
    slow_parser = commands.add_parser("slow", help="slow and idle connections must not stop the service")
    slow_parser.add_argument("--stalled", type=int, default=1000, help="connections that send half a request line")
    slow_parser.add_argument("--idle", type=int, default=1000, help="idle keep-alive connections")
    slow_parser.add_argument("--header-timeout", type=float, default=8, help="the server's header_timeout_seconds")
    slow_parser.add_argument("--model", default="models/fashion-compose-f8", help="a model folder")
    slow_parser.add_argument("--deadline", type=int, default=300, help="seconds for the whole run")
    memory_parser = commands.add_parser("memory", help="no upload, body, job or mix of requests passes the budget")
    memory_parser.add_argument("--budget-mib", type=int, default=1024, help="the server's max_memory_megabytes")
    memory_parser.add_argument("--side", type=int, default=5700, help="the uploaded image's side (5700: 2^25 pixels, "
                               "nearly)")
    memory_parser.add_argument("--half-bodies", type=int, default=200, help="connections mid-way through a 4 MB body")
    memory_parser.add_argument("--jobs", type=int, default=64, help="finished jobs to fill the store with")
    memory_parser.add_argument("--mixed", type=int, default=64, help="generations with settings of their own")
    memory_parser.add_argument("--model", default="models/fashion-compose-f8", help="a model folder")
    memory_parser.add_argument("--deadline", type=int, default=900, help="seconds for the whole run")
    args = parser.parse_args()
    args.source = args.source.resolve()
    args.tools = (args.tools or args.source / "build" / "tools").resolve()
    {"load": load, "bench": bench, "slow": slow, "memory": memory}[args.mode](args)


if __name__ == "__main__":
    main()
