"""The parsers of ``benchmarks/bench_vs_peers.py`` against recorded llama.cpp output (tests/fixtures/peers).

No peer engine runs here: the fixtures are the tools' real output, recorded once (see their README).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.paths import FIXTURES, ROOT, load_file_module

PEERS = FIXTURES / "peers"


def load_bench() -> ModuleType:
    if str(ROOT / "benchmarks") not in sys.path:   # as when it runs as a script: it imports benchmarks/revisions.py
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return load_file_module(ROOT / "benchmarks" / "bench_vs_peers.py")


bench = load_bench()


def test_batched_bench_jsonl() -> None:
    rows = bench.parse_batched_bench((PEERS / "llama-batched-bench.jsonl").read_text())
    assert [(r["pp"], r["tg"], r["pl"]) for r in rows] == [(64, 8, 1), (64, 8, 2)]
    assert rows[1]["speed_pp"] == pytest.approx(26.692768)
    assert rows[1]["speed_tg"] == pytest.approx(1.487364)
    # the tool's own definitions: all pl*pp prompt tokens over t_pp, all pl*tg new tokens over t_tg
    for r in rows:
        assert r["speed_pp"] == pytest.approx(r["pl"] * r["pp"] / r["t_pp"], rel=1e-5)
        assert r["speed_tg"] == pytest.approx(r["pl"] * r["tg"] / r["t_tg"], rel=1e-5)


def test_batched_bench_markdown_table() -> None:
    rows = bench.parse_batched_bench((PEERS / "llama-batched-bench.md").read_text())
    assert [(r["pp"], r["tg"], r["pl"], r["n_kv"]) for r in rows] == [(256, 32, 1, 288), (256, 32, 4, 1152)]
    assert (rows[0]["speed_pp"], rows[0]["speed_tg"]) == (38.74, 4.06)


def test_batched_bench_without_rows_is_an_error() -> None:
    # llama-batched-bench skips a shape silently when the context is too small: only the header is printed
    header = "\n".join((PEERS / "llama-batched-bench.md").read_text().splitlines()[:5])
    with pytest.raises(ValueError, match="no result rows"):
        bench.parse_batched_bench(header)


def test_llama_bench_jsonl() -> None:
    (row,) = bench.parse_llama_bench((PEERS / "llama-bench.jsonl").read_text())
    assert (row["n_prompt"], row["n_gen"], row["n_depth"]) == (0, 8, 128)
    assert row["avg_ts"] == pytest.approx(14.606931)


def test_perplexity_kld() -> None:
    assert bench.parse_kld((PEERS / "llama-perplexity-kld.txt").read_text()) == pytest.approx(0.005378)
    with pytest.raises(ValueError, match="Mean KLD"):
        bench.parse_kld("Final estimate: PPL = 16.9110 +/- 4.35706")


def test_kv8_before_revision_is_checked() -> None:
    # --kv8-before names a commit of this repository; anything else is refused before any engine starts
    proc = subprocess.run([sys.executable, str(Path(bench.__file__)), "--engines", "kv8", "--kv8-before",
                           "no-such-revision-xyz"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--kv8-before: 'no-such-revision-xyz' is not a commit" in proc.stderr
    assert "ready in" not in proc.stdout


def test_worker_pause_stops_its_process_group(tmp_path) -> None:
    """pause() stops the worker and the children it started (state T), resume() lets them run again."""
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
    code = (child + f"print({bench.RESULT_MARK!r} + '{{}}', flush=True); sys.stdin.readline()")
    with open(tmp_path / "log", "w") as log:
        worker = bench.Worker([sys.executable, "-c", code], {}, log)

        def states() -> list[str]:
            pids = [worker.proc.pid] + [int(p) for p in Path(f"/proc/{worker.proc.pid}/task/{worker.proc.pid}/children")
                                        .read_text().split()]
            return [Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] for pid in pids]

        def wait_for(ok: Callable[[list[str]], bool]) -> list[str]:   # the child starts after the handshake, and
            for _ in range(500):                                       # signals are delivered asynchronously
                now = states()
                if ok(now):
                    break
                time.sleep(0.01)
            return now

        assert len(wait_for(lambda s: len(s) == 2)) == 2 and "T" not in wait_for(lambda s: "T" not in s)
        worker.pause()
        assert wait_for(lambda s: s == ["T", "T"]) == ["T", "T"]
        worker.resume()
        assert "T" not in wait_for(lambda s: "T" not in s)
        worker.close()
        with contextlib.suppress(ProcessLookupError):   # the sleeping child, left in the worker's group
            os.killpg(worker.proc.pid, signal.SIGKILL)


def test_the_table_prints_each_cells_spread_over_the_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    """Medians per cell, then (max - min) / median per cell, so a ratio can be read against the machine's drift."""
    shape = bench.Shape(8, 1024, 128)
    cfg = bench.Config("kv8", "fp8_e4m3")
    cfg.results[shape] = [bench.Measurement(1000.0, 100.0, 1.0), bench.Measurement(1200.0, 110.0, 1.2),
                          bench.Measurement(800.0, 90.0, 0.8)]
    bench.print_table([cfg], [shape], None)
    out = capsys.readouterr().out.splitlines()
    row = next(line for line in out if line.startswith("kv8 fp8_e4m3") and "1000.0" in line)
    assert row.split()[2:4] == ["1000.0", "100.0"]                    # the medians
    spread = out[out.index(next(line for line in out if line.startswith("spread"))) + 1].split()
    assert spread[2:4] == ["40%", "20%"]                              # (1200 - 800) / 1000, (110 - 90) / 100
    one_round = bench.Config("kv8", "bfloat16")
    one_round.results[shape] = [bench.Measurement(1.0, 1.0, 1.0)]
    bench.print_table([one_round], [shape], None)
    assert not any(line.startswith("spread") for line in capsys.readouterr().out.splitlines())


def test_peer_cache_types_are_checked() -> None:
    assert bench.peer_cache_types("--llama-kv", "f16, q8_0,q4_0,q8_0", bench.LLAMA_KV_TYPES) == ("f16", "q8_0", "q4_0")
    with pytest.raises(ValueError, match=r"--llama-kv: q3_k is not a cache type it takes; choose from: f32, f16"):
        bench.peer_cache_types("--llama-kv", "q8_0,q3_k", bench.LLAMA_KV_TYPES)
    with pytest.raises(ValueError, match=r"--vllm-kv: ' , ' is not"):
        bench.peer_cache_types("--vllm-kv", " , ", bench.VLLM_KV_TYPES)


def test_a_bad_peer_cache_type_is_refused_before_any_engine_starts() -> None:
    proc = subprocess.run([sys.executable, str(Path(bench.__file__)), "--engines", "llama.cpp", "--llama-kv",
                           "q8_0,int4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--llama-kv: int4 is not a cache type it takes" in proc.stderr
    assert "ready in" not in proc.stdout


def test_kv8_runs_report_the_fewest_threads_their_steps_had(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kv8 measurement carries the fewest threads its steps ran with: all of them on a quiet machine; one when the
    thread governor gives a core up to other processes (its answer faked here), which the run's summary line names.
    Peers report none (0), and the median of a cell keeps the fewest."""
    import torch

    from kv8.engine.threads import ThreadGovernor

    before = torch.get_num_threads()
    monkeypatch.setattr(bench, "make_prompts", lambda batch, length, seed: [[(seed + 7 * i + j) % 300 + 1
                                                                             for j in range(length)]
                                                                            for i in range(batch)])   # its vocab
    try:
        measure = next(bench.kv8_worker({"model": tiny_llama, "kv_cache_dtype": "fp8"}, 2, 64))
        quiet = measure(bench.Shape(2, 32, 3), 1)
        assert quiet.threads == bench.THREADS and quiet.prefill_tok_s > 0

        def busy_machine(self: ThreadGovernor) -> int:   # the governor's answer to other processes on a core
            self.threads = 1
            self.set_threads(1)
            return 1

        monkeypatch.setattr(ThreadGovernor, "observe", busy_machine)
        busy = measure(bench.Shape(2, 32, 3), 2)
        assert busy.threads == 1
    finally:
        torch.set_num_threads(before)
    shape = bench.Shape(2, 32, 3)
    cfg, peer = bench.Config("kv8", "fp8"), bench.Config("vllm", "auto")
    cfg.results[shape] = [quiet]
    peer.results[shape] = [bench.Measurement(1.0, 1.0, 1.0)]
    assert bench.governor_summary([cfg, peer]) == (f"every kv8 step ran with all {bench.THREADS} threads (the thread "
                                                   "governor gave none up)")
    cfg.results[shape].append(busy)
    assert cfg.median(shape).threads == 1
    assert bench.governor_summary([cfg, peer]) == (f"kv8's thread governor gave up threads in 1 run(s): kv8 fp8 B=2 "
                                                   f"(1 of {bench.THREADS})")


def test_kv8_before_adds_kv8s_configurations_only() -> None:
    # --kv8-before measures each kv8 configuration again at the revision; the peers' cache types are never run as
    # kv8 configurations at that revision (they once were: their workers failed to start and were skipped)
    kv8 = [bench.Config("kv8", "bfloat16", {"kv_cache_dtype": "bfloat16"}, "--kv-cache-dtype bfloat16"),
           bench.Config("kv8", "fp8_e4m3", {"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype fp8_e4m3")]
    peers = {"llama.cpp": ["f16", "q8_0"], "vllm": ["auto"]}
    names = [c.name for c in bench.configs_to_run(kv8, peers, ("abc1234", "/tmp/tree"))]
    assert names == ["kv8 bfloat16", "kv8 fp8_e4m3", "kv8@abc1234 bfloat16", "kv8@abc1234 fp8_e4m3",
                     "llama.cpp f16", "llama.cpp q8_0", "vllm auto"]
    olds = bench.configs_to_run(kv8, peers, ("abc1234", "/tmp/tree"))[2:4]
    assert all(c.tree == "/tmp/tree" and c.options == k.options for c, k in zip(olds, kv8))
    assert [c.name for c in bench.configs_to_run(kv8, peers, None)] == [
        "kv8 bfloat16", "kv8 fp8_e4m3", "llama.cpp f16", "llama.cpp q8_0", "vllm auto"]
    assert [c.name for c in bench.configs_to_run([], {"vllm": ["fp8"]}, None)] == ["vllm fp8"]
