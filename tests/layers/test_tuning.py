"""kv8.layers.tuning: the per-machine choice of the dense backend. Timing is faked (timing stays in benchmarks):
the tuner picks the faster candidate over rounds that a burst of other work does not decide, writes and reads its
plan file, times again a plan timed beside other work (keeping the quieter timing), ignores a plan of another machine
or version, and falls back when the file is corrupt or cannot be written. The float32 linear method it may pick
computes what the reference does."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kv8.cpu_load import CpuClock
from kv8.kernels.cpu.dense import FP8_REGISTER_ROWS
from kv8.layers.dense_backend import GGUF_BF16_ROWS, GGUF_DEQUANTIZE_ROWS, DenseBackend
from kv8.layers.linear import WIDE_ROWS, Linear, TorchF32LinearMethod, linear_method, linear_reference
from kv8.layers.tuning import (
    BUSY_CORES,
    EARLY_MARGIN,
    FP8_SHORT_REGISTER_ROWS,
    PREFILL_ROWS,
    TIMED_ROWS,
    TUNE_ROUNDS,
    LinearShape,
    PlanStore,
    TuneResult,
    candidate_ids,
    candidates,
    choose,
    plan_key,
    time_layer,
    timed_rows,
    tuned_dense_backend,
    tuning_groups,
)
from kv8.machine_plans import PLAN_VERSION, fastest_call
from kv8.quant.weights import dequantize_fp8_rows, quantize_fp8_rows
from tests.helpers.kernels import dense_kernels_or_reason

SHAPES = [LinearShape(96, 64, 4), LinearShape(64, 160, 4), LinearShape(1000, 64, 1, quantize=False, lm_head=True)]
MACHINE = {"cpu": "Test CPU", "isa": "avx2 fma", "kv8": "0.1.0", "torch": "2.13.0", "threads": "2"}


def tuned(*args: Any, **kwargs: Any) -> tuple[DenseBackend, TuneResult]:
    """:func:`tuned_dense_backend` on a model timed as one group (no GGUF blocks): the backend and the one plan."""
    backend, results = tuned_dense_backend(*args, **kwargs)
    assert list(results) == [None]
    return backend, results[None]


class FakeMeasure:
    """Seconds per layer call from a table ``{(backend name, rows): seconds}`` (a candidate it does not list, such as
    packed_bf16 where this machine's kernels load: ``default``, slower than any listed); counts the calls."""

    def __init__(self, table: dict[tuple[str, int], float], default: float = 100.0) -> None:
        self.table, self.default, self.calls = table, default, 0

    def __call__(self, backend: DenseBackend, shape: LinearShape, rows: int) -> float:
        self.calls += 1
        return self.table.get((backend.name, rows), self.default) * shape.out_features * shape.in_features / 1e4


TWO = {"torch": DenseBackend("torch"), "torch_fp32": DenseBackend("torch_fp32")}


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner's reading of other processes' CPU use: none here (a test that needs one sets its own), so that a
    busy test machine does not make these plans provisional."""
    monkeypatch.setattr("kv8.layers.tuning.read_cpu_clock", lambda cpus: None)


class BusyClock:
    """/proc/stat readings in which other processes take ``others`` cores over each second between two readings."""

    def __init__(self, others: float) -> None:
        self.others, self.t = others, 0.0

    def __call__(self, cpus: frozenset[int]) -> CpuClock:
        self.t += 1.0
        return CpuClock(self.t, self.others * self.t, 0.0)


def test_the_faster_candidate_wins_counting_decode_and_prefill_alike() -> None:
    fp32_wins = FakeMeasure({("torch", 1): 9.0, ("torch", PREFILL_ROWS): 3.0,
                             ("torch_fp32", 1): 1.0, ("torch_fp32", PREFILL_ROWS): 2.0})
    result = choose(TWO, SHAPES, torch.bfloat16, fp32_wins)
    assert result.choice == "torch_fp32" and result.speedup("torch", 1) == pytest.approx(9.0)
    # each candidate, shape and row count (the LM head: 1 and PREFILL_ROWS rows), in two rounds: torch_fp32 led both
    # by far more than EARLY_MARGIN
    assert fp32_wins.calls == 2 * 2 * (len(TIMED_ROWS) * (len(SHAPES) - 1) + 2)
    # each row count weighs alike: 1.1x slower at one row but 2x faster at the other loses overall
    torch_wins = FakeMeasure({("torch", 1): 1.0, ("torch", PREFILL_ROWS): 1.0,
                              ("torch_fp32", 1): 1.1, ("torch_fp32", PREFILL_ROWS): 0.5})
    assert choose(TWO, SHAPES, torch.bfloat16, torch_wins).choice == "torch_fp32"
    torch_wins.table[("torch_fp32", PREFILL_ROWS)] = 0.95
    assert choose(TWO, SHAPES, torch.bfloat16, torch_wins).choice == "torch"
    # the seconds are a pass over the model: shape time x its layer count
    assert result.seconds["torch"][1] == pytest.approx(sum(9.0 * s.out_features * s.in_features / 1e4 * s.count
                                                           for s in SHAPES))
    assert "<- chosen" in result.table().splitlines()[2] and result.table().splitlines()[2].startswith("torch_fp32")
    with pytest.raises(ValueError, match="no dense backend"):
        choose({}, SHAPES, torch.bfloat16, fp32_wins)


def test_the_packed_kernels_are_chosen_by_measurement_like_any_candidate() -> None:
    """On a machine where the kernels load (AVX2 as AVX-512) packed_bf16 competes with torch_fp32: it wins where it
    measures faster (a decode step reading half the bytes) and loses where it does not."""
    kernels, why = dense_kernels_or_reason()
    if kernels is None:
        pytest.skip(f"kv8's dense kernels are unavailable: {why}")
    three = {"packed_bf16": DenseBackend("packed_bf16", kernels), **TWO}
    packed_wins = FakeMeasure({("packed_bf16", 1): 1.0, ("packed_bf16", PREFILL_ROWS): 1.2,
                               ("torch_fp32", 1): 2.0, ("torch_fp32", PREFILL_ROWS): 1.0,
                               ("torch", 1): 9.0, ("torch", PREFILL_ROWS): 9.0})
    result = choose(three, SHAPES, torch.bfloat16, packed_wins)
    assert result.choice == "packed_bf16" and result.speedup("torch_fp32", 1) == pytest.approx(2.0)
    packed_wins.table[("packed_bf16", PREFILL_ROWS)] = 3.0      # 2x faster at 1 row, 3x slower at 64: loses
    assert choose(three, SHAPES, torch.bfloat16, packed_wins).choice == "torch_fp32"


def test_fastest_call_takes_the_fastest_of_several_on_its_clock() -> None:
    ticks = iter([0.0, 5.0, 5.0, 6.0, 6.0, 9.0] + [9.0] * 200)
    calls = []
    assert fastest_call(lambda: calls.append(1), clock=lambda: next(ticks), min_time=8.0) == 1.0
    assert len(calls) == 4   # a warm-up, then until 8 s were spent (5 + 1 + 3)
    ticks = iter([0.0, 5.0, 5.0, 6.0] + [9.0] * 200)
    calls.clear()
    assert fastest_call(lambda: calls.append(1), clock=lambda: next(ticks), min_time=1.0, warm_up=False) == 1.0
    assert len(calls) == 2   # no warm-up call: two timed ones


def test_the_lm_head_is_timed_at_the_rows_whose_logits_a_step_computes() -> None:
    """The LM head (lm_head) multiplies one row per sequence of a step: timed at 1 and PREFILL_ROWS rows, and
    a long prompt's chunk (WIDE_ROWS) counts its 1-row time; the decoder's layers are timed at every row count."""
    seen: list[tuple[int, int]] = []

    def measure(backend: DenseBackend, shape: LinearShape, rows: int) -> float:
        seen.append((shape.out_features, rows))
        return {"torch": 1.0, "torch_fp32": 2.0}[backend.name] * rows * (10.0 if shape.lm_head else 1.0)

    result = choose(TWO, SHAPES, torch.bfloat16, measure, rounds=1)
    assert sorted(set(seen)) == sorted({(s.out_features, r) for s in SHAPES[:2] for r in TIMED_ROWS}
                                       | {(1000, 1), (1000, PREFILL_ROWS)})
    assert timed_rows(SHAPES[2], WIDE_ROWS) == 1 and timed_rows(SHAPES[2], PREFILL_ROWS) == PREFILL_ROWS
    assert timed_rows(SHAPES[0], WIDE_ROWS) == WIDE_ROWS
    assert timed_rows(LinearShape(1000, 64, 1, qtype="Q4_1", lm_head=True), WIDE_ROWS) == 1   # GGUF blocks too
    assert result.seconds["torch"][WIDE_ROWS] == pytest.approx(4 * WIDE_ROWS + 4 * WIDE_ROWS + 10.0)


def test_a_leader_of_every_round_by_a_wide_margin_ends_the_timing_after_two_rounds() -> None:
    """Two rounds when one candidate leads both, by its own times, and its score is EARLY_MARGIN below every other's;
    every round when the lead is narrower, or when the rounds disagree (a burst of other work in one of them)."""
    def rounds_of(fast: float, slow: float, burst_round: int = -1) -> tuple[int, str]:
        calls = [0]
        per_round = 2 * (len(TIMED_ROWS) * (len(SHAPES) - 1) + 2)

        def measure(backend: DenseBackend, shape: LinearShape, rows: int) -> float:
            round_ = calls[0] // per_round
            calls[0] += 1
            took = {"torch": fast, "torch_fp32": slow}[backend.name]
            return took * (20.0 if backend.name == "torch" and round_ == burst_round else 1.0)

        result = choose(TWO, SHAPES, torch.bfloat16, measure)
        return calls[0] // per_round, result.choice

    assert rounds_of(1.0, 1.5) == (2, "torch")                         # 1.5x slower: two rounds suffice
    wide = 1.0 + EARLY_MARGIN * 1.01
    assert rounds_of(1.0, wide) == (2, "torch")                        # just over the margin
    assert rounds_of(1.0, 1.0 + EARLY_MARGIN * 0.99) == (TUNE_ROUNDS, "torch")   # within it: every round
    assert rounds_of(1.0, 1.5, burst_round=0) == (TUNE_ROUNDS, "torch")  # round 1 led by the other: every round
    assert rounds_of(1.0, 1.5, burst_round=1) == (TUNE_ROUNDS, "torch")
    assert choose(TWO, SHAPES, torch.bfloat16, lambda b, s, r: 1.0, rounds=3, early_margin=0.0).choice == "torch"


def test_the_timer_packs_each_shape_once_for_the_packed_candidates() -> None:
    """packed_bf16 and packed_bf16+f32_from_512 time layers that share one packed weight (each with its own method),
    FP8 weights too; each candidate's layer is built once over the rounds."""
    kernels, why = dense_kernels_or_reason()
    if kernels is None:
        pytest.skip(f"kv8's dense kernels are unavailable: {why}")
    from kv8.layers.tuning import _LayerTimer

    for quantization in (None, "fp8"):
        timer = _LayerTimer(torch.bfloat16)
        plain, wide = DenseBackend("packed_bf16", kernels, quantization), \
            DenseBackend("packed_bf16", kernels, quantization, wide_rows=WIDE_ROWS)
        shape = LinearShape(96, 64, 2)
        for backend in (plain, wide, plain):
            assert timer.measure(backend, shape, 1) > 0
        a, b = timer.layers[(plain.label, shape)], timer.layers[(wide.label, shape)]
        assert a.packed.data_ptr() == b.packed.data_ptr() and len(timer.built) == 1
        if quantization == "fp8":   # codes decoded into a buffer from 17 rows: the same packed codes, its own method
            short = DenseBackend("packed_bf16", kernels, "fp8", fp8_register_rows=FP8_SHORT_REGISTER_ROWS)
            assert timer.measure(short, shape, 1) > 0 and len(timer.built) == 1
            c = timer.layers[(short.label, shape)]
            assert c.packed.data_ptr() == a.packed.data_ptr()
            assert c.method.register_rows == FP8_SHORT_REGISTER_ROWS   # type: ignore[attr-defined]
        assert a.method.wide_rows == 0 and b.method.wide_rows == WIDE_ROWS   # type: ignore[attr-defined]
        x = torch.randn(WIDE_ROWS, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
        torch.testing.assert_close(a(x).float(), b(x).float(), rtol=2 ** -7, atol=2 ** -7)   # the same weights
        timer.measure(DenseBackend("torch", None, quantization), shape, 1)
        assert len(timer.built) == 2 and len(timer.weights) == 1   # another layout, the same random weights


def test_rounds_take_the_candidates_in_turn_and_a_burst_does_not_decide() -> None:
    """Other work that slows one candidate's turn in one round (a compiler beside the timing) does not decide the
    choice: each candidate keeps its fastest time over the rounds, and no candidate is always timed first."""
    order: list[str] = []

    def measure(backend: DenseBackend, shape: LinearShape, rows: int) -> float:
        order.append(backend.name)
        fast = {"torch": 1.0, "torch_fp32": 2.0}[backend.name]
        burst = backend.name == "torch" and len(order) <= 2 * len(SHAPES) * len(TIMED_ROWS)   # round 1: 10x
        return fast * (10.0 if burst else 1.0)

    result = choose(TWO, SHAPES, torch.bfloat16, measure)
    assert result.choice == "torch" and result.speedup("torch_fp32", 1) == pytest.approx(2.0)
    per_round = 2 * len(SHAPES) * len(TIMED_ROWS)
    firsts = {order[r * per_round] for r in range(TUNE_ROUNDS)}
    assert firsts == {"torch", "torch_fp32"}                   # the order rotates between rounds
    assert choose(TWO, SHAPES, torch.bfloat16, measure, rounds=1).choice == "torch"
    with pytest.raises(ValueError, match="rounds=0 must be >= 1"):
        choose(TWO, SHAPES, torch.bfloat16, measure, rounds=0)


def test_a_plan_timed_beside_other_work_is_timed_again_and_the_quieter_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    store = PlanStore(tmp_path, MACHINE)
    measure = FakeMeasure({("torch", 1): 4.0, ("torch", PREFILL_ROWS): 4.0,
                           ("torch_fp32", 1): 1.0, ("torch_fp32", PREFILL_ROWS): 1.0})
    monkeypatch.setattr("kv8.layers.tuning.read_cpu_clock", BusyClock(1.0))   # a busy core elsewhere
    with caplog.at_level(logging.WARNING, logger="kv8"):
        _, busy = tuned(SHAPES, torch.bfloat16, None, store, measure)
    assert busy is not None and busy.others == pytest.approx(1.0) and busy.provisional
    assert "provisional" in caplog.text and "other processes took 1.00 cores" in busy.table()
    assert store.get(plan_key(SHAPES, torch.bfloat16, None)).others == pytest.approx(1.0)   # type: ignore[union-attr]
    # the next start times again; a busier timing does not replace the kept one
    calls = measure.calls
    monkeypatch.setattr("kv8.layers.tuning.read_cpu_clock", BusyClock(1.5))
    _, kept = tuned(SHAPES, torch.bfloat16, None, store, measure)
    assert measure.calls > calls and kept is not None and kept.others == pytest.approx(1.0)
    # a quiet timing replaces it and is then read, not timed
    monkeypatch.setattr("kv8.layers.tuning.read_cpu_clock", BusyClock(BUSY_CORES / 2))
    _, quiet = tuned(SHAPES, torch.bfloat16, None, store, measure)
    assert quiet is not None and not quiet.provisional and "beside other work" not in quiet.table()
    calls = measure.calls
    _, again = tuned(SHAPES, torch.bfloat16, None, store, measure)
    assert measure.calls == calls and again is not None and again.others == pytest.approx(BUSY_CORES / 2)


def test_the_plan_is_written_then_read_and_not_timed_again(tmp_path: Path) -> None:
    store = PlanStore(tmp_path, MACHINE)
    measure = FakeMeasure({("torch", 1): 4.0, ("torch", PREFILL_ROWS): 4.0,
                           ("torch_fp32", 1): 1.0, ("torch_fp32", PREFILL_ROWS): 1.0})
    backend, result = tuned(SHAPES, torch.bfloat16, None, store, measure)
    calls = measure.calls
    assert result is not None and backend.name == result.choice
    assert store.path.parent == tmp_path and store.path.exists()
    data = json.loads(store.path.read_text())
    assert data["machine"] == MACHINE and list(data["plans"]) == [plan_key(SHAPES, torch.bfloat16, None)]
    again, plan = tuned(SHAPES, torch.bfloat16, None, PlanStore(tmp_path, MACHINE), measure)
    assert measure.calls == calls and again.name == backend.name   # read, not timed
    assert plan is not None and plan.seconds == result.seconds and plan.measured == result.measured
    assert plan.rounds == result.rounds == 2   # torch_fp32 led both rounds by 4x: no third
    # another model (or dtype, or quantization) is another plan in the same file
    tuned(SHAPES[:1], torch.bfloat16, None, PlanStore(tmp_path, MACHINE), measure)
    tuned(SHAPES, torch.bfloat16, "fp8", PlanStore(tmp_path, MACHINE), measure)
    assert len(json.loads(store.path.read_text())["plans"]) == 3
    tuned(SHAPES, torch.bfloat16, None, PlanStore(tmp_path, MACHINE), measure, retune=True)
    assert measure.calls > calls   # retune times again


def test_a_plan_that_timed_other_candidates_is_timed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A plan written before a candidate existed (or before kv8's kernels were rebuilt: another library file) never
    passes that candidate over: the candidates are timed again and the new plan records them."""
    import kv8.layers.tuning as tuning

    store = PlanStore(tmp_path, MACHINE)
    key = plan_key(SHAPES, torch.bfloat16, None)
    # a plan from before plans recorded what they timed, and one that timed only torch and torch_fp32
    store.put(key, TuneResult("torch_fp32", {"torch": {1: 2.0}, "torch_fp32": {1: 1.0}}))
    assert store.get(key) is not None and store.get(key).timed == ()   # type: ignore[union-attr]

    class Library:
        def __init__(self, build: str) -> None:
            self.path = Path(f"/cache/kernels/{build}.so")

    three = TWO | {"packed_bf16": DenseBackend("packed_bf16", Library("aaaa"))}   # type: ignore[arg-type]
    monkeypatch.setattr(tuning, "candidates", lambda *args: dict(three))
    packed_wins = FakeMeasure({("torch", 1): 4.0, ("torch", PREFILL_ROWS): 4.0, ("torch_fp32", 1): 2.0,
                               ("torch_fp32", PREFILL_ROWS): 2.0, ("packed_bf16", 1): 1.0,
                               ("packed_bf16", PREFILL_ROWS): 1.0})
    with caplog.at_level(logging.WARNING, logger="kv8"):
        backend, result = tuned(SHAPES, torch.bfloat16, None, store, packed_wins)
    assert backend.name == "packed_bf16" and packed_wins.calls > 0
    assert "timing again" in caplog.text
    assert result is not None and result.timed == ("packed_bf16@aaaa", "torch", "torch_fp32") == candidate_ids(three)
    assert store.get(key).timed == result.timed   # type: ignore[union-attr]
    # the same candidates: read, not timed
    calls = packed_wins.calls
    tuned(SHAPES, torch.bfloat16, None, store, packed_wins)
    assert packed_wins.calls == calls
    # the kernels rebuilt (another library file): timed again
    three["packed_bf16"] = DenseBackend("packed_bf16", Library("bbbb"))   # type: ignore[arg-type]
    _, again = tuned(SHAPES, torch.bfloat16, None, store, packed_wins)
    assert packed_wins.calls > calls and again is not None and "packed_bf16@bbbb" in again.timed


@pytest.mark.parametrize("other", [{"cpu": "Another CPU"}, {"isa": "avx2 fma avx512f"}, {"kv8": "0.2.0"},
                                   {"torch": "2.14.0"}])
def test_a_plan_of_another_machine_or_version_is_ignored(tmp_path: Path, other: dict[str, str]) -> None:
    theirs = PlanStore(tmp_path, MACHINE | other)
    key = plan_key(SHAPES, torch.bfloat16, None)
    theirs.put(key, TuneResult("torch", {"torch": {1: 1.0}}))
    mine = PlanStore(tmp_path, MACHINE)
    assert mine.path != theirs.path and mine.get(key) is None
    theirs.path.rename(mine.path)            # even under this machine's file name
    assert mine.get(key) is None


def test_a_corrupt_file_is_timed_again_and_an_unwritable_one_still_chooses(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    store = PlanStore(tmp_path, MACHINE)
    store.path.write_text("{not json")
    measure = FakeMeasure({("torch", 1): 1.0, ("torch", PREFILL_ROWS): 1.0,
                           ("torch_fp32", 1): 2.0, ("torch_fp32", PREFILL_ROWS): 2.0})
    with caplog.at_level(logging.WARNING, logger="kv8"):
        backend, _ = tuned(SHAPES, torch.bfloat16, None, store, measure)
    assert backend.name == "torch" and "unreadable" in caplog.text
    assert json.loads(store.path.read_text())["plans"]   # rewritten whole
    # a well-formed file whose entry is damaged: timed again
    data = json.loads(store.path.read_text())
    data["plans"][plan_key(SHAPES, torch.bfloat16, None)] = {"dense_backend": "torch", "seconds": "?"}
    store.path.write_text(json.dumps(data))
    calls = measure.calls
    tuned(SHAPES, torch.bfloat16, None, store, measure)
    assert measure.calls > calls
    # an entry that timed today's candidates but names none of them as its choice: timed again, not a KeyError
    data = json.loads(store.path.read_text())
    data["plans"][plan_key(SHAPES, torch.bfloat16, None)]["dense_backend"] = "no_such_backend"
    store.path.write_text(json.dumps(data))
    calls = measure.calls
    backend, _ = tuned(SHAPES, torch.bfloat16, None, store, measure)
    assert measure.calls > calls and backend.name == "torch"
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    unwritable = PlanStore(blocked / "tuning", MACHINE)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kv8"):
        backend, result = tuned(SHAPES, torch.bfloat16, None, unwritable, measure)
    assert backend.name == "torch" and result is not None and "could not write the tuning plan" in caplog.text


def test_candidates_by_dtype_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    names = set(candidates(SHAPES, torch.bfloat16, None))
    wide = f"packed_bf16+f32_from_{WIDE_ROWS}"
    assert {"torch", "torch_fp32"} <= names <= {"torch", "torch_fp32", "packed_bf16", wide}
    # the packed kernels are a candidate wherever they load (AVX-512 BF16 or AVX2 + FMA + F16C), FP8 weights too;
    # and the same kernels with long chunks in float32 (bf16 weights widened, FP8 codes decoded times their scales)
    kernels, _ = dense_kernels_or_reason()
    assert ("packed_bf16" in names) == (wide in names) == (kernels is not None)
    if kernels is not None:
        fp8 = candidates(SHAPES, torch.bfloat16, "fp8")
        assert fp8["packed_bf16"].kernels is kernels and fp8["packed_bf16"].quantization == "fp8"
        assert fp8[wide].quantization == "fp8" and fp8[wide].wide_rows == WIDE_ROWS and fp8[wide].kernels is kernels
        assert candidates(SHAPES, torch.bfloat16, None)[wide].wide_rows == WIDE_ROWS
        # FP8 codes decoded into a buffer from FP8_SHORT_REGISTER_ROWS + 1 rows: a candidate on the vdpbf16ps path
        # only (AMX decodes its own way, the AVX2 path has no such switch), for FP8 weights only
        buffered = {f"packed_bf16+fp8_buffer_from_{FP8_SHORT_REGISTER_ROWS + 1}",
                    f"{wide}+fp8_buffer_from_{FP8_SHORT_REGISTER_ROWS + 1}"}
        vdpbf16ps = kernels.isa == "avx512" and not kernels.amx
        assert (buffered <= set(fp8)) == vdpbf16ps and not buffered & set(candidates(SHAPES, torch.bfloat16, None))
        assert all(fp8[name].fp8_register_rows == FP8_SHORT_REGISTER_ROWS for name in buffered & set(fp8))
        assert fp8["packed_bf16"].fp8_register_rows == fp8[wide].fp8_register_rows == FP8_REGISTER_ROWS
    assert set(candidates(SHAPES, torch.float32, None)) == {"torch"}    # nothing to widen, no bf16 kernels
    assert "packed_bf16" not in candidates(SHAPES, torch.float16, None)
    monkeypatch.setattr("kv8.layers.tuning.memory_available", lambda: 1000)   # float32 weights would not fit
    assert "torch_fp32" not in candidates(SHAPES, torch.bfloat16, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_float32_method_computes_the_reference(dtype: torch.dtype, fp8: bool) -> None:
    """Odd shapes, a bias, leading dims: equal to linear_reference on the same (for FP8: dequantized) weights up
    to the order of float32 additions, and the layer keeps no 16-bit copy of its weights."""
    g = torch.Generator().manual_seed(1)
    backend = DenseBackend("torch_fp32", None, "fp8" if fp8 else None)
    layer = Linear(37, 19, bias=True, backend=backend)
    layer.method = linear_method(backend, quantize=True)
    assert isinstance(layer.method, TorchF32LinearMethod)
    weight = (torch.randn(19, 37, generator=g) * 0.1).to(dtype)
    bias = torch.randn(19, generator=g).to(dtype)
    layer.weight.data, layer.bias.data = weight.clone(), bias.clone()   # type: ignore[union-attr]
    layer.process_weights_after_loading()
    assert not hasattr(layer, "weight") and layer.weight_f32.dtype == torch.float32
    x = torch.randn(2, 3, 37, generator=g).to(dtype)
    if fp8:   # the packed FP8 kernel's arithmetic: the 16-bit weight's E4M3 codes, decode(code) * scale in float32
        weight = dequantize_fp8_rows(*quantize_fp8_rows(weight), torch.float32)
    ref = linear_reference(x, weight, bias)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, 3, 19)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=float(torch.finfo(dtype).eps) * 4)


def test_an_engine_uses_and_keeps_this_machines_plan(tiny_llama: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """dense_backend=auto with tuning on: the first engine times and writes the plan, the second reads it."""
    from tests.helpers.engine import make_llm

    monkeypatch.setenv("KV8_TUNING", "auto")
    monkeypatch.setenv("KV8_CACHE_DIR", os.fspath(tmp_path))
    monkeypatch.setattr("kv8.machine_plans.machine_key", lambda: MACHINE)
    first = make_llm(tiny_llama, kv_cache_dtype="fp8", dtype="bfloat16")   # float32 models have one candidate
    plans = list((tmp_path / "tuning").glob("*.json"))
    assert len(plans) == 1
    (entry,) = json.loads(plans[0].read_text())["plans"].values()
    assert first.engine.dense_backend == entry["dense_backend"]
    entry_time = plans[0].stat().st_mtime_ns
    second = make_llm(tiny_llama, kv_cache_dtype="fp8", dtype="bfloat16")
    assert second.engine.dense_backend == first.engine.dense_backend and plans[0].stat().st_mtime_ns == entry_time


def test_gguf_weights_time_the_dequantizing_switch_against_the_int8_kernel_everywhere() -> None:
    """``quantization="gguf"``: where the kernels read every quantized shape's block type, two candidates -- the
    blocks dequantized for the float32 GEMM from ``GGUF_DEQUANTIZE_ROWS`` rows, and the int8 kernel at every row
    count -- and a third, the blocks dequantized to the packed kernel's bf16 from ``GGUF_BF16_ROWS`` rows, timed on
    layers holding blocks of that type (the real timer here, on tiny shapes); a shape without a type the kernels read
    leaves the fixed rule, untimed. The choice's speed-ups are quoted against the other."""
    kernels, why = dense_kernels_or_reason()
    if kernels is None or "Q4_1" not in kernels.gguf_types:
        pytest.skip(f"kv8's GGUF kernels are unavailable: {why}")
    shapes = [LinearShape(48, 64, 2, qtype="Q4_1"), LinearShape(40, 64, 1, qtype="Q8_0")]
    found = candidates(shapes, torch.bfloat16, "gguf")
    switch, bf16 = f"packed_bf16+f32_from_{GGUF_DEQUANTIZE_ROWS}", f"packed_bf16+bf16_from_{GGUF_BF16_ROWS}"
    assert set(found) == {switch, "packed_bf16", bf16}
    assert (found[switch].wide_rows, found["packed_bf16"].wide_rows) == (GGUF_DEQUANTIZE_ROWS, 0)
    assert (found[bf16].wide_rows, found[bf16].gguf_expand) == (GGUF_BF16_ROWS, "bf16")
    for label, backend in found.items():
        assert time_layer(shapes[0], backend, torch.bfloat16, 40) > 0, label
    unreadable = [LinearShape(48, 64, 2, qtype=None)]
    (only,) = candidates(unreadable, torch.bfloat16, "gguf").values()
    assert only.wide_rows == GGUF_DEQUANTIZE_ROWS
    with pytest.raises(ValueError, match="needs its block type"):
        time_layer(unreadable[0], found["packed_bf16"], torch.bfloat16, 1)
    two = {label: found[label] for label in (switch, "packed_bf16")}
    result = choose(two, shapes, torch.bfloat16,
                    lambda backend, shape, rows: 1.0 if backend.wide_rows and rows >= backend.wide_rows else 0.5)
    assert result.choice == "packed_bf16" and result.compared_with == switch
    assert result.speedup(result.compared_with, WIDE_ROWS) == pytest.approx(2.0)
    assert TuneResult("torch", {"torch": {1: 1.0}, "packed_bf16": {1: 2.0}}).compared_with == "torch"


class FakeGGUFKernels:
    """What the tuner reads of kv8's kernels with GGUF blocks: the block types they read, the library's file."""

    gguf_types = ("Q4_K", "Q6_K", "Q8_0")
    path = Path("/cache/kernels/gguf.so")


def test_gguf_layers_are_timed_and_switched_in_their_own_block_type(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``quantization="gguf"``: each block type's layers are timed alone, a shape of one (N, K) in two types as two
    shapes in their own types (Gemma-3-270M's Q4_K_M file: nine Q4_K and nine Q6_K down projections); the LM head
    (its switch is fixed) and a type the kernels do not read (multiplied alike at every row count) are not timed.
    Each type gets its own plan, and the backend switches each type at its own choice -- the int8 kernel, or from its
    switch on the blocks dequantized to float32 or to bf16; where every type chooses the same candidate, the backend
    is that candidate."""
    import kv8.layers.tuning as tuning

    kernels = FakeGGUFKernels()
    switch = DenseBackend("packed_bf16", kernels, "gguf", wide_rows=GGUF_DEQUANTIZE_ROWS)   # type: ignore[arg-type]
    int8 = DenseBackend("packed_bf16", kernels, "gguf")   # type: ignore[arg-type]
    bf16 = DenseBackend("packed_bf16", kernels, "gguf", wide_rows=GGUF_BF16_ROWS, gguf_expand="bf16")   # type: ignore[arg-type]
    found = {switch.label: switch, int8.label: int8, bf16.label: bf16}
    monkeypatch.setattr(tuning, "candidates", lambda *args: dict(found))
    shapes = [LinearShape(640, 2048, 9, qtype="Q4_K"), LinearShape(640, 2048, 9, qtype="Q6_K"),
              LinearShape(640, 1024, 18, qtype="Q4_K"), LinearShape(256, 640, 9, qtype="Q8_0"),
              LinearShape(1536, 640, 9, qtype="Q5_K"), LinearShape(1000, 640, 1, qtype="Q8_0", lm_head=True)]
    groups = tuning_groups(shapes, found)
    assert groups == {"Q4_K": [shapes[0], shapes[2]], "Q6_K": [shapes[1]], "Q8_0": [shapes[3]]}
    timed: list[tuple[str, LinearShape]] = []
    wins = {"Q6_K": switch.label, "Q8_0": bf16.label}   # (the others: the int8 kernel)

    def measure(backend: DenseBackend, shape: LinearShape, rows: int) -> float:
        timed.append((backend.label, shape))
        return 1.0 if rows == 1 or backend.label == wins.get(shape.qtype or "", int8.label) else 3.0

    store = PlanStore(tmp_path, MACHINE)
    backend, results = tuned_dense_backend(shapes, torch.bfloat16, "gguf", store, measure)
    assert {shape for _, shape in timed} == {shapes[0], shapes[1], shapes[2], shapes[3]}
    assert {label for label, _ in timed} == set(found)
    assert {qtype: result.choice for qtype, result in results.items()} == {"Q4_K": int8.label, "Q6_K": switch.label,
                                                                          "Q8_0": bf16.label}
    assert backend.gguf_wide_rows == (("Q4_K", 0), ("Q6_K", GGUF_DEQUANTIZE_ROWS), ("Q8_0", GGUF_BF16_ROWS))
    assert backend.gguf_bf16 == ("Q8_0",)
    assert backend.label == (f"packed_bf16[Q4_K:int8,Q6_K:f32_from_{GGUF_DEQUANTIZE_ROWS},"
                             f"Q8_0:bf16_from_{GGUF_BF16_ROWS}]")
    method = linear_method(backend)
    assert [method.dequantize_rows_of(q) for q in ("Q4_K", "Q6_K", "Q8_0")] == [0, GGUF_DEQUANTIZE_ROWS, GGUF_BF16_ROWS]   # type: ignore[attr-defined]
    assert [method.expansion_of(q) for q in ("Q4_K", "Q6_K", "Q8_0")] == ["f32", "f32", "bf16"]   # type: ignore[attr-defined]
    data = json.loads(store.path.read_text())
    assert data["version"] == PLAN_VERSION
    assert set(data["plans"]) == {plan_key(group, torch.bfloat16, "gguf") for group in groups.values()}
    # read, not timed
    calls = len(timed)
    again, plans = tuned_dense_backend(shapes, torch.bfloat16, "gguf", PlanStore(tmp_path, MACHINE), measure)
    assert len(timed) == calls and again == backend and plans.keys() == results.keys()
    # the int8 kernel faster for every type: the candidate itself
    wins.clear()
    same, _ = tuned_dense_backend(shapes, torch.bfloat16, "gguf", store, measure, retune=True)
    assert same == int8 and same.gguf_wide_rows == ()
    # the bf16 expansion faster for every type: that candidate itself
    wins.update({"Q4_K": bf16.label, "Q6_K": bf16.label, "Q8_0": bf16.label})
    same, _ = tuned_dense_backend(shapes, torch.bfloat16, "gguf", store, measure, retune=True)
    assert same == bf16 and linear_method(same).expansion_of("Q4_K") == "bf16"   # type: ignore[attr-defined]


def test_a_plan_file_of_another_version_is_timed_again(tmp_path: Path) -> None:
    """A file written by another plan version (1: GGUF layers timed in one type) is an empty store, never read as
    this version's plans; the next plan written replaces it."""
    store = PlanStore(tmp_path, MACHINE)
    key = plan_key(SHAPES, torch.bfloat16, None)
    store.put(key, TuneResult("torch", {"torch": {1: 1.0}}))
    data = json.loads(store.path.read_text())
    store.path.write_text(json.dumps(data | {"version": PLAN_VERSION - 1}))
    assert store.get(key) is None
    store.put(key, TuneResult("torch_fp32", {"torch_fp32": {1: 1.0}}))
    assert json.loads(store.path.read_text())["version"] == PLAN_VERSION and store.get(key).choice == "torch_fp32"   # type: ignore[union-attr]
