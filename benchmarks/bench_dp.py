"""Data-parallel replicas on Ray Serve vs one engine on the same cores, behind the same HTTP load, in one run.

Two servers are started one after the other on the same model and KV budget per engine:

* ``ray``: ``kv8 serve --data-parallel-size N --data-parallel-backend ray --cpu-threads-per-rank T`` (N replicas
  of T threads each, a new local Ray cluster);
* ``single``: ``kv8 serve`` with one engine of N x T threads (``OMP_NUM_THREADS``).

Each gets the same load: ``--clients`` concurrent clients, each sending ``--requests`` completions one after the
other (distinct fixed prompts, greedy, ``--max-tokens`` generated tokens each, ``ignore_eos``), after one warm-up
request per replica. Prints generated tokens per second, requests per second and the p50 / p99 end-to-end
latency of each, and the ray / single ratios.

    .venv/bin/python benchmarks/bench_dp.py                       # SmolLM2-135M, 2 x 1 thread vs 1 x 2 threads
    .venv/bin/python benchmarks/bench_dp.py --clients 8 --requests 2 --max-tokens 16   # a quick run
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

WORDS = ("river mountain lantern copper violet harbor meadow engine signal orchard thunder pebble canyon "
         "saffron glacier compass").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompt(i: int) -> str:
    """A distinct prompt per request (no shared prefix beyond a few characters)."""
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(12)]
    return f"Story {i}: " + " ".join(words) + ". Continue the story:"


class Server:
    def __init__(self, args: list[str], env: dict[str, str], timeout: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="bench_dp_", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "kv8.entrypoints.cli", "serve", *args, "--port",
                                      str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env}, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited early; log: {self.log.name}")
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"server not ready after {timeout:.0f} s; log: {self.log.name}")
            with open(self.log.name, "rb") as f:
                ready = b"kv8: serving" in f.read()
            if ready:
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def load(url: str, model: str, args: argparse.Namespace, warmup: int) -> dict[str, float]:
    body = dict(model=model, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with httpx.Client(timeout=600) as c:
        for i in range(warmup):
            c.post(url + "/v1/completions", json=dict(body, prompt=prompt(10_000 + i))).raise_for_status()

    def client(k: int) -> list[tuple[float, int]]:
        out = []
        with httpx.Client(timeout=600) as c:
            for j in range(args.requests):
                t0 = time.perf_counter()
                r = c.post(url + "/v1/completions", json=dict(body, prompt=prompt(k * args.requests + j)))
                r.raise_for_status()
                out.append((time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]))
        return out

    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = [x for part in pool.map(client, range(args.clients)) for x in part]
    wall = time.perf_counter() - start
    lat = sorted(x for x, _ in results)
    tokens = sum(n for _, n in results)
    return {"tok_s": tokens / wall, "req_s": len(results) / wall, "p50": statistics.median(lat),
            "p99": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], "wall": wall, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads-per-replica", type=int, default=1)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="256MiB", help="per engine")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    args = ap.parse_args()
    n, t = args.replicas, args.threads_per_replica
    engine = ["--model", args.model, "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs",
              str(args.max_num_seqs)]
    results = {}
    for name, flags, env, warmup in (
            ("ray", [*engine, "-dp", str(n), "-dpb", "ray", "--cpu-threads-per-rank", str(t)],
             {"RAY_ADDRESS": ""}, 2 * n),
            ("single", engine, {"OMP_NUM_THREADS": str(n * t)}, 2)):
        t0 = time.perf_counter()
        server = Server(flags, env)
        started = time.perf_counter() - t0
        try:
            results[name] = load(server.url, args.model, args, warmup)
        finally:
            server.stop()
        print(f"{name}: ready in {started:.0f} s, load took {results[name]['wall']:.1f} s", flush=True)
    print(f"\n{args.model}: {args.clients} clients x {args.requests} requests, {args.max_tokens} tokens each "
          f"(greedy), {os.cpu_count()} cores; ray = {n} replicas x {t} thread(s), single = 1 engine x {n * t}")
    print(f"{'':<10}{'tok/s':>10}{'req/s':>10}{'p50 s':>10}{'p99 s':>10}")
    for name, r in results.items():
        print(f"{name:<10}{r['tok_s']:>10.1f}{r['req_s']:>10.2f}{r['p50']:>10.2f}{r['p99']:>10.2f}")
    ray, single = results["ray"], results["single"]
    print(f"{'ray/single':<10}{ray['tok_s'] / single['tok_s']:>10.2f}{ray['req_s'] / single['req_s']:>10.2f}"
          f"{ray['p50'] / single['p50']:>10.2f}{ray['p99'] / single['p99']:>10.2f}")


if __name__ == "__main__":
    main()
