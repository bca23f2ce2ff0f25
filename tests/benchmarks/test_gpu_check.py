"""``benchmarks/gpu_check.py``: its verdicts, exit status, L2 rotation and deadline on the CPU, and the script at its
smoke shapes through Triton's interpreter (the run a GPU makes, before it gets there). The smoke numbers mean
nothing; the shapes of the results, the verdicts' plumbing and what the script asserts (every row timed, the fp8
cache holding twice the bf16 sequences in one budget, the blocks returned) do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT, load_file_module

gpu_check = load_file_module(ROOT / "benchmarks" / "gpu_check.py")

MiB = 2**20
ALL = ("attention", "formats", "sweep", "probe", "engine", "tests")


def _row(batch: int, context: int, roles: tuple[str, ...], fp8_of_copy: float, fp8_over_bf16: float,
         bf16_over_sdpa: float | None) -> dict:
    return {"batch": batch, "context": context, "roles": list(roles), "fp8_e4m3": {"of_copy": fp8_of_copy},
            "fp8_over_bf16": fp8_over_bf16, "bf16_over_sdpa": bf16_over_sdpa}


def _passing() -> dict:
    """Results at the targets' numbers exactly (a target is met at its threshold)."""
    return {"attention": [_row(1, 32768, ("long",), 0.5, 1.6, 1.0),
                          _row(32, 4096, ("long", "bandwidth"), 0.7, 2.0, 1.25),
                          _row(128, 2048, ("bandwidth",), 0.9, 1.0, 1.1)],
            "engine": {"fp8_over_bf16_at_budget": 1.3}, "tests": {"returncode": 0}}


def _by_target(result: dict, ran=ALL) -> dict[str, dict]:
    return {v["target"]: v for v in gpu_check.verdicts(result, ran)}


def test_every_target_passes_at_its_number():
    got = _by_target(_passing())
    assert [v["verdict"] for v in got.values()] == ["PASS"] * 5
    # each value is the worst row of its role: fp8 of copy over the bandwidth rows, fp8 / bf16 over the long rows,
    # bf16 / SDPA over every row (1 x 32k's 0.5 of copy and 128 x 2k's 1.0x over bf16 are outside their roles)
    assert [got[k]["value"] for k in ("fp8_of_copy", "fp8_over_bf16", "bf16_over_sdpa")] == [0.7, 1.6, 1.25]
    assert gpu_check.exit_status(list(got.values()), deadline_hit=False) == gpu_check.EXIT_OK == 0


@pytest.mark.parametrize("change,target", [
    (lambda r: r["attention"][2]["fp8_e4m3"].update(of_copy=0.69), "fp8_of_copy"),
    (lambda r: r["attention"][0].update(fp8_over_bf16=1.59), "fp8_over_bf16"),
    (lambda r: r["attention"][1].update(bf16_over_sdpa=1.26), "bf16_over_sdpa"),
    (lambda r: r["engine"].update(fp8_over_bf16_at_budget=1.29), "engine_fp8_over_bf16"),
    (lambda r: r["tests"].update(returncode=1), "tests"),           # a test failed: pytest's code is passed on
    (lambda r: r["tests"].update(returncode=None), "tests"),        # the tests ran out of time
    (lambda r: r["attention"][1].update(bf16_over_sdpa=None), "bf16_over_sdpa"),   # flash could not run
    (lambda r: r.pop("engine"), "engine_fp8_over_bf16"),             # the section ran without its number
    (lambda r: r["attention"].pop(2) and r["attention"].pop(1), "fp8_of_copy"),   # no row of its role
])
def test_a_missed_or_missing_number_fails_its_target_and_the_run(change, target):
    result = _passing()
    change(result)
    got = _by_target(result)
    assert {k for k, v in got.items() if v["verdict"] == "FAIL"} == {target}
    assert gpu_check.exit_status(list(got.values()), deadline_hit=False) == gpu_check.EXIT_MISSED == 1


def test_sections_not_run_are_skipped_and_the_deadline_wins():
    got = gpu_check.verdicts({"tests": {"returncode": 0}}, ["tests"])
    assert [v["verdict"] for v in got] == ["SKIP"] * 4 + ["PASS"]
    assert gpu_check.exit_status(got, deadline_hit=False) == 0
    assert gpu_check.exit_status(got, deadline_hit=True) == gpu_check.EXIT_DEADLINE == 3
    text = gpu_check.format_verdicts(gpu_check.verdicts({}, ["engine"]))
    assert "  FAIL  end-to-end decode tok/s, FP8 KV >= 1.3x bf16 KV at one KV budget: not measured (>= 1.3)" in text
    assert "  SKIP  the GPU tests pass" in text


def test_rotation_leaves_the_l2_none_of_the_next_calls_bytes():
    l2 = 50 * MiB   # an H100's
    assert gpu_check.rotation_count(64 * MiB, l2, 2**33) == 3      # 1 x 32k fp8: two others stream 128 MiB >= 2 L2
    assert gpu_check.rotation_count(256 * MiB, l2, 2**33) == 2     # larger than the L2: never the same copy twice
    assert gpu_check.rotation_count(MiB, l2, 2**33) == 101
    assert gpu_check.rotation_count(MiB, 0, 2**33) == 2
    with pytest.raises(ValueError, match="101 copies of 1048576 bytes .* exceed 67108864 bytes"):
        gpu_check.rotation_count(MiB, l2, 64 * MiB)
    with pytest.raises(ValueError, match="working_set=0 must be > 0"):
        gpu_check.rotation_count(0, l2, 2**33)


def test_deadline_counts_on_its_clock():
    now = [100.0]
    deadline = gpu_check.Deadline(480, clock=lambda: now[0])
    assert deadline.left() == 480 and not deadline.expired()
    now[0] = 579.5
    assert deadline.left() == 0.5 and deadline.elapsed() == 479.5
    now[0] = 581
    assert deadline.left() == 0 and deadline.expired()
    with pytest.raises(ValueError, match="deadline=0 must be > 0 seconds"):
        gpu_check.Deadline(0)


def test_the_tests_section_passes_pytests_return_code_on(tmp_path, monkeypatch):
    (tmp_path / "test_one.py").write_text("def test_fails():\n    assert 1 == 2\n")
    monkeypatch.setattr(gpu_check, "TEST_FILES", (str(tmp_path / "test_one.py"),))
    result: dict = {}
    gpu_check.run_tests(120, result, tmp_path / "tests.log")
    assert result["returncode"] == 1 and "1 failed" in result["summary"]
    assert len(result["failures"]) == 1 and result["failures"][0].startswith("FAILED ")
    assert result["failures"][0].endswith("test_one.py::test_fails - assert 1 == 2")
    assert "assert 1 == 2" in (tmp_path / "tests.log").read_text()
    assert _by_target({"tests": result}, ["tests"])["tests"]["verdict"] == "FAIL"
    (tmp_path / "test_one.py").write_text("def test_passes():\n    pass\n")
    gpu_check.run_tests(120, result)
    assert result["returncode"] == 0 and _by_target({"tests": result}, ["tests"])["tests"]["verdict"] == "PASS"


def _env() -> dict[str, str]:
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))


def test_the_deadline_stops_the_run_with_what_it_has(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--deadline", "2",
                           "--json", str(out)], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the deadline of 2 s passed during attention" in proc.stdout and "verdicts:" in proc.stdout
    result = json.loads(out.read_text())
    assert result["deadline_hit"] and result["exit_status"] == 3
    assert [v["verdict"] for v in result["verdicts"]] == ["FAIL"] * 3 + ["SKIP"] * 2   # engine, tests never began


@pytest.mark.slow
def test_smoke_run_writes_every_section_and_its_verdicts(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--skip", "tests",
                           "formats", "sweep", "probe", "--json", str(out)], env=_env(), capture_output=True, text=True,
                          timeout=900)
    result = json.loads(out.read_text())
    # the interpreter's numbers miss the GPU's targets: the run exits 1, having judged every measured one
    assert proc.returncode == 1 == result["exit_status"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["smoke"] and "tests" not in result and result["copy_GBps"] > 0 and not result["deadline_hit"]
    assert [(r["batch"], r["context"]) for r in result["attention"]] == [(1, 64), (2, 48)]
    for row in result["attention"]:
        for name in ("fp8_e4m3", "bfloat16", "sdpa"):
            assert row[name]["us"] > 0 and row[name]["gbps"] > 0 and row[name]["copies"] == 2
        assert row["sdpa"]["backend"] == "flash"
    bf16, fp8 = result["engine"]["at_max_batch"]
    assert (bf16["batch"], fp8["batch"]) == (3, 6)   # one budget: an fp8 cache holds twice the sequences
    assert fp8["kv_capacity_tokens"] == 2 * bf16["kv_capacity_tokens"]
    for row in (bf16, fp8):
        assert row["decode_tokens"] == row["batch"] * row["decode_steps"] and row["tok_s"] > 0
    verdicts = {v["target"]: v for v in result["verdicts"]}
    assert verdicts["tests"]["verdict"] == "SKIP"
    assert all(v["value"] is not None for k, v in verdicts.items() if k != "tests")
    assert "verdicts:" in proc.stdout and "fp8 / bf16 KV decode tok/s at one KV budget" in proc.stdout


def test_format_rows_time_every_format_and_count_its_bytes(monkeypatch):
    """The formats section at one tiny shape in the interpreter: every format of :data:`FORMATS` timed against the
    row's FP8 time, its bytes read counted from its own rows and per-token scales (head_dim 32: int8 32 + 4 bytes a
    side; int4 16 + 4; int4_per_group32 16 + 2, no token scale; k8v4 int8 K and int4_per_group32 V)."""
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CUDA process: the GPU check times the formats there")
    monkeypatch.setitem(gpu_check.TIMING, "launches", 1)
    monkeypatch.setitem(gpu_check.TIMING, "repeats", 1)
    rows = [{"batch": 1, "context": 40, "fp8_e4m3": {"us": 100.0}}]
    gpu_check.format_rows(rows, torch.device("cpu"), copy_bps=1e9, l2=0, heads_q=4, heads_kv=2, dim=32)
    got = rows[0]["formats"]
    assert list(got) == list(gpu_check.FORMATS)
    per_token_head = {"int8_per_token_head": 72, "int4_per_token_head": 40, "int4_per_group32": 36, "k8v4": 54}
    for name, timing in got.items():
        assert timing["read_bytes"] == 1 * 40 * 2 * per_token_head[name], name
        assert timing["us"] > 0 and timing["over_fp8"] == pytest.approx(100.0 / timing["us"])
        assert timing["copies"] == 2


def test_refuses_to_run_on_the_cpu_outside_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA GPU: run with TRITON_INTERPRET=1" in proc.stderr


def test_each_request_outlasts_the_timed_steps():
    """A request whose prompt is prefilled early decodes a token in each later prefill step (mixed batches): its
    max_tokens covers those and the timed steps, and the batch is sized for that growth (an H200 run timed steps of
    54 and 62 of 65 and 131 sequences when each request had decode_steps + 4 tokens)."""
    assert gpu_check.request_tokens(1, 2048, 32) == 1 + 32 + 4
    assert gpu_check.request_tokens(131, 2048, 32) == 33 + 32 + 4      # 131 x 2048 prompt tokens in 8192-token steps
    assert gpu_check.request_tokens(2, 10000, 32) == 2 + 32 + 4       # a prompt longer than 8192: one per step
    for blocks, want in ((8704, 65), (17408, 130)):   # 17 GiB of bf16 / fp8 KV at Llama-3.1-8B's 128 KiB per token
        bound = gpu_check.admissible_batch(blocks, 16, 2048, 2048 + 36)
        batch = gpu_check.admissible_batch(blocks, 16, 2048, 2048 + gpu_check.request_tokens(bound, 2048, 32))
        assert batch == want
        assert batch * -(-(2048 + gpu_check.request_tokens(batch, 2048, 32)) // 16) <= blocks


@pytest.mark.slow
def test_timed_steps_hold_the_whole_batch_when_the_prefill_takes_several_steps(tmp_path, monkeypatch):
    """Prompts prefilled over several steps (64-token steps: 2 x 40 tokens in 2), requests sized by
    :func:`request_tokens`: every timed decode step holds the whole batch."""
    monkeypatch.setattr(gpu_check, "max_batched_tokens", lambda context: 64)
    model = gpu_check.make_model_dir(tmp_path / "model", gpu_check.TINY_LLAMA)
    batch = gpu_check.batch_in_budget(model, "bfloat16", 40, 3, 64 * 1024, "cpu", "triton")
    assert batch == 2 and gpu_check.request_tokens(batch, 40, 3) == 2 + 3 + 4
    row = gpu_check.engine_decode(model, "bfloat16", batch, 40, 3, 64 * 1024, "cpu", "triton")
    assert row["full_batch"] and row["decode_tokens"] == batch * 3


def test_the_probe_tells_a_wrong_kernel_and_store(monkeypatch):
    """The 4-bit probe can fail: an attention that leaves its output zero reads WRONG in every variant, a store
    that writes nothing differs from the reference store's bytes."""
    import torch

    import kv8.kernels.triton.attention as A
    import kv8.kernels.triton.store as S

    monkeypatch.setattr(A, "unified_attention", lambda query, k, v, out, **kw: out.zero_())
    monkeypatch.setattr(S, "store_kv", lambda *a, **kw: None)
    result: dict = {}
    gpu_check.probe_packed(torch.device("cpu"), result, formats=("int4_per_token_head",))
    row = result["int4_per_token_head"]
    assert row["store_bit_exact"] is False
    for name, _ in gpu_check.PROBE_VARIANTS:
        assert row[name]["right"] is False and row[name]["max_abs_err"] > 0.1


@pytest.mark.slow
def test_the_probe_and_the_sweep_in_the_interpreter(monkeypatch):
    """In the interpreter (right at every head_dim) the probe reads every variant right and the Triton store bit for
    bit the reference's; the refusal of 4-bit codes above head_dim 128 is back after it; the sweep times each
    variant of the FP8 decode."""
    import torch

    import kv8.kernels.triton.attention as A
    from kv8.kernels.triton.formats import check_compiled_packed_head_dim

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CUDA process: the GPU check runs the probe there")
    result: dict = {}
    gpu_check.probe_packed(torch.device("cpu"), result, formats=("int4_per_group32",))
    row = result["int4_per_group32"]
    assert row["store_bit_exact"] is True
    assert all(row[name]["right"] for name, _ in gpu_check.PROBE_VARIANTS)
    assert A.check_compiled_packed_head_dim is check_compiled_packed_head_dim
    monkeypatch.setitem(gpu_check.TIMING, "launches", 1)
    monkeypatch.setitem(gpu_check.TIMING, "repeats", 1)
    rows = [{"batch": 1, "context": 40}]
    gpu_check.sweep_rows(rows, torch.device("cpu"), copy_bps=1e9, l2=0, heads_q=4, heads_kv=2, dim=32)
    assert list(rows[0]["sweep"]) == [name for name, _ in gpu_check.SWEEP_VARIANTS]
    assert all(v["us"] > 0 for v in rows[0]["sweep"].values())
    assert A.launch_config.__module__ == A.__name__      # the sweep's replacement is gone
