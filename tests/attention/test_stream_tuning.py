"""The decode attention's stream distance (``stream_tiles``) and its per-machine tuner (kv8.attention.tuning): the
kernels give the same bits at every distance, bad distances are refused, and the tuner picks the faster distance on
a fake clock, keeps it in the plan file, reads it back, and times again where the plan is another build's, damaged or
provisional. Timing itself stays in benchmarks (bench_attention.py --tables stream)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kv8.attention.metadata import AttentionMetadata
from kv8.attention.tuning import (
    MIN_GAIN,
    STREAM_CANDIDATES,
    TIE,
    StreamCase,
    choose_stream_tiles,
    plan_entry_key,
    streams,
    tuned_stream_tiles,
)
from kv8.cache.codec import KVCodec
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.cache.plan import KVSpec
from kv8.kernels.cpu.attention import KernelLibrary, paged_attention_fused
from kv8.machine_plans import MachinePlans
from kv8.quant.formats import resolve_kv_cache_dtypes
from kv8.quant.scales import KVScales
from tests.helpers.kernels import load_or_skip

MACHINE = {"cpu": "test cpu", "isa": "avx2", "kv8": "0", "torch": "0", "threads": "2"}


def spec_of(name: str) -> KVSpec:
    k, v = resolve_kv_cache_dtypes(name, torch.bfloat16)
    return KVSpec.of(k, v_dtype=v)


def case_of(name: str, head_dim: int = 64) -> StreamCase:
    return StreamCase(spec_of(name), 4, 2, head_dim, 16)


class FakeLib:
    """What the tuner reads of the library: its default and largest distance, its build, the fast path."""

    default_stream_tiles, max_stream_tiles, has_fast_path, path = 3, 16, True, "/x/libkv8attn-abc123.so"


def fake_lib() -> KernelLibrary:
    return FakeLib()   # type: ignore[return-value]


def clock(per_tiles: dict[int, float], calls: list[int] | None = None):
    """``measure(case) -> measure(n)`` returning ``per_tiles[n]`` (1.0 for a distance not listed)."""
    def measure(case: StreamCase):
        def one(n: int) -> float:
            if calls is not None:
                calls.append(n)
            return per_tiles.get(n, 1.0)
        return one
    return measure


# ---- the kernels ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp8_e4m3", "bfloat16", "int8_per_token_head", "int4_per_token_head",
                                  "int4_per_group32", "fp4_e2m1", "k8v4"])
def test_every_distance_gives_the_same_bits(name: str) -> None:
    """A decode batch (sequences of 37, 200 and 515 tokens: partial tiles, several tiles, partitions) over scattered
    blocks: the output at every distance equals the default's bit for bit."""
    lib = load_or_skip()
    gen = torch.Generator().manual_seed(0)
    spec, lens, bs, d = spec_of(name), [37, 200, 515], 16, 64
    blocks = sum(-(-n // bs) for n in lens) + 3
    static_fp8 = spec.kv_dtype.is_fp8 and not spec.dynamic
    cache = PagedKVCache(CacheShape(1, blocks, 2, bs, d),
                         KVCodec.build(spec.kv_dtype, d, scale_mode="dynamic" if spec.dynamic else "static",
                                       scales=KVScales.default(1) if static_fp8 else None, v_dtype=spec.v_dtype))
    k, v = (torch.randn(blocks * bs, 2, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    lib.store(k, v, cache, 0, torch.arange(blocks * bs))
    ids = torch.randperm(blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(ids[at:at + -(-n // bs)])
        at += len(tables[-1])
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, bs)
    q = torch.randn(len(lens), 8, d, generator=gen).to(torch.bfloat16)
    ref = paged_attention_fused(lib, q, cache, 0, meta, d ** -0.5)
    for n in range(1, lib.max_stream_tiles + 1):
        out = paged_attention_fused(lib, q, cache, 0, meta, d ** -0.5, stream_tiles=n)
        assert torch.equal(out, ref), f"stream_tiles={n} changed the result"


def test_a_distance_outside_the_range_is_refused() -> None:
    lib = load_or_skip()
    assert 1 <= lib.default_stream_tiles <= lib.max_stream_tiles
    for bad in (-1, lib.max_stream_tiles + 1, 2.0):
        with pytest.raises(ValueError, match=r"stream_tiles=.* must be an int in \[0, "):
            paged_attention_fused(lib, torch.zeros(1, 2, 64, dtype=torch.bfloat16), None, 0, None, 1.0,  # type: ignore[arg-type]
                                  stream_tiles=bad)   # type: ignore[arg-type]


# ---- the choice ----------------------------------------------------------------------------------------------------

def test_the_fastest_median_wins_and_every_distance_is_timed_in_each_round() -> None:
    calls: list[int] = []
    choice = choose_stream_tiles(3, clock({4: 0.8, 5: 0.85}, calls)(case_of("fp8_e4m3")), rounds=5)
    assert choice.stream_tiles == 4 and choice.default == 3
    assert choice.speedup == pytest.approx(1.0 / 0.8)
    assert sorted(set(calls)) == sorted({3, *STREAM_CANDIDATES})
    assert all(calls.count(n) == 5 + 1 for n in set(calls))   # a warm-up pass, then one per round
    firsts = {calls[len(set(calls)) * (r + 1)] for r in range(5)}   # each round starts with another distance
    assert len(firsts) == 5


def test_a_gain_inside_the_margin_keeps_the_default() -> None:
    choice = choose_stream_tiles(3, clock({6: 1.0 - MIN_GAIN / 2})(case_of("fp8_e4m3")))
    assert choice.stream_tiles == 3 and choice.speedup == 1.0
    assert choose_stream_tiles(3, clock({6: 1.0 - 2 * MIN_GAIN})(case_of("fp8_e4m3"))).stream_tiles == 6


def test_the_median_is_robust_to_one_slow_pass() -> None:
    """One burst of other work during a distance's turn does not decide the choice."""
    times = iter([1.0] * 7 + [0.5] + [1.0] * 100)   # the 8th call (a timed pass of some distance) looks fast once
    choice = choose_stream_tiles(3, lambda n: next(times), candidates=(2, 3, 4, 5, 6, 8))
    assert choice.stream_tiles == 3


def test_of_distances_tied_with_the_fastest_the_nearest_the_default_wins() -> None:
    assert choose_stream_tiles(3, clock({4: 0.9, 6: 0.9 * (1 - TIE / 2), 8: 0.9 * (1 - TIE / 2)})(None)).stream_tiles \
        == 4
    assert choose_stream_tiles(3, clock({4: 0.9, 6: 0.9 * (1 - 2 * TIE)})(None)).stream_tiles == 6
    assert choose_stream_tiles(4, clock({3: 0.8, 5: 0.8})(None), candidates=(3, 5)).stream_tiles == 3   # the shorter


def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rounds=0"):
        choose_stream_tiles(3, lambda n: 1.0, rounds=0)


# ---- the plan file -------------------------------------------------------------------------------------------------

def test_the_choice_is_kept_and_read_back_without_timing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kv8.attention.tuning.read_cpu_clock", lambda cpus: None)
    plans, case = MachinePlans(tmp_path, MACHINE), case_of("fp8_e4m3")
    first = tuned_stream_tiles(fake_lib(), [case, case], 2, plans, measure=clock({5: 0.7}))
    assert list(first) == [case] and first[case].stream_tiles == 5 and first[case].build == "libkv8attn-abc123"
    entry = json.loads(plans.path.read_text())["plans"][plan_entry_key(case)]
    assert entry["stream_tiles"] == 5 and entry["default"] == 3 and set(entry["seconds"]) >= {"3", "5"}
    calls: list[int] = []
    again = tuned_stream_tiles(fake_lib(), [case], 2, plans, measure=clock({4: 0.1}, calls))
    assert again[case].stream_tiles == 5 and not calls
    retuned = tuned_stream_tiles(fake_lib(), [case], 2, plans, retune=True, measure=clock({4: 0.1}, calls))
    assert retuned[case].stream_tiles == 4 and calls


def test_each_format_and_shape_has_its_own_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kv8.attention.tuning.read_cpu_clock", lambda cpus: None)
    plans = MachinePlans(tmp_path, MACHINE)
    by_case = {case_of("fp8_e4m3"): {4: 0.5}, case_of("int4_per_token_head"): {6: 0.5}, case_of("bfloat16"): {},
               case_of("fp8_e4m3", 128): {2: 0.5}}
    chosen = tuned_stream_tiles(fake_lib(), list(by_case), 2, plans, measure=lambda c: clock(by_case[c])(c))
    assert [c.stream_tiles for c in chosen.values()] == [4, 6, 3, 2]
    assert len(json.loads(plans.path.read_text())["plans"]) == 4
    assert case_of("k8v4").formats == ("int8_per_token_head", "int4_per_group32")


def test_a_plan_of_another_build_a_damaged_entry_or_a_foreign_file_is_timed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kv8.attention.tuning.read_cpu_clock", lambda cpus: None)
    plans, case = MachinePlans(tmp_path, MACHINE), case_of("int8_per_token_head")
    tuned_stream_tiles(fake_lib(), [case], 2, plans, measure=clock({5: 0.5}))
    key = plan_entry_key(case)
    data = json.loads(plans.path.read_text())
    for damage in ({"build": "libkv8attn-other"}, {"stream_tiles": "x"}, {"stream_tiles": 99}, {"default": 4},
                   {"seconds": None}):
        broken = json.loads(json.dumps(data))
        broken["plans"][key] |= damage
        plans.path.write_text(json.dumps(broken))
        calls: list[int] = []
        assert tuned_stream_tiles(fake_lib(), [case], 2, plans, measure=clock({6: 0.5}, calls))[case].stream_tiles \
            == 6 and calls, damage
        plans.path.write_text(json.dumps(data))
    plans.path.write_text("{not json")
    assert tuned_stream_tiles(fake_lib(), [case], 2, plans, measure=clock({2: 0.5}))[case].stream_tiles == 2
    theirs = MachinePlans(tmp_path, MACHINE | {"cpu": "another cpu"})
    assert theirs.path != plans.path and theirs.entry(key) is None


def test_a_choice_timed_beside_other_work_is_provisional(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Used, timed again at the next start; of two busy timings the quieter is kept."""
    busy = iter([1.0, 0.5, 2.0])
    monkeypatch.setattr("kv8.attention.tuning.read_cpu_clock", lambda cpus: object())
    monkeypatch.setattr("kv8.attention.tuning.others_cores", lambda before, after: next(busy))
    plans, case = MachinePlans(tmp_path, MACHINE), case_of("fp8_e4m3")
    first = tuned_stream_tiles(fake_lib(), [case], 2, plans, measure=clock({4: 0.5}))[case]
    assert first.provisional and first.stream_tiles == 4
    second = tuned_stream_tiles(fake_lib(), [case], 2, plans, measure=clock({5: 0.5}))[case]
    assert second.stream_tiles == 5 and second.others == 0.5   # quieter: kept
    third = tuned_stream_tiles(fake_lib(), [case], 2, plans, measure=clock({6: 0.5}))[case]
    assert third.stream_tiles == 5   # busier than what is kept
    assert json.loads(plans.path.read_text())["plans"][plan_entry_key(case)]["stream_tiles"] == 5


def test_an_unwritable_plan_directory_still_gives_a_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kv8.attention.tuning.read_cpu_clock", lambda cpus: None)
    blocked = tmp_path / "file"
    blocked.write_text("")
    plans = MachinePlans(blocked / "tuning", MACHINE)
    assert tuned_stream_tiles(fake_lib(), [case_of("fp8_e4m3")], 2, plans,
                              measure=clock({4: 0.5}))[case_of("fp8_e4m3")].stream_tiles == 4
    assert not plans.path.exists()


def test_cases_the_decode_kernels_do_not_read_are_not_timed(tmp_path: Path) -> None:
    plans, calls = MachinePlans(tmp_path, MACHINE), []
    lib = fake_lib()
    untimed = [case_of("fp8_e4m3", 16), StreamCase(spec_of("fp8_e4m3"), 4, 2, 64, 16, torch.float32),
               StreamCase(spec_of("fp8_e4m3"), 4, 2, 64, 8)]
    chosen = tuned_stream_tiles(lib, untimed, 2, plans, measure=clock({4: 0.1}, calls))
    assert not calls and all(c.stream_tiles == 3 and not c.seconds for c in chosen.values())
    assert not plans.path.exists()
    assert streams(lib, case_of("fp8_e4m3")) and not streams(lib, untimed[0])


# ---- the engine ----------------------------------------------------------------------------------------------------

def test_an_engine_attends_with_this_machines_choice(tiny_llama: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With tuning on, the engine times (here on a fake clock) its pool's format on its heads and attends with the
    choice (the tiny model's head_dim of 16 is not one the decode kernels read, so the check is made to say it is);
    the generated tokens equal those of an engine with tuning off."""
    from kv8.attention.cpu_fused import FusedCPUBackend
    from tests.helpers.engine import make_llm, tokens_of

    prompts = [[1, 5, 9, 14, 3], [7, 2]]
    off = tokens_of(make_llm(tiny_llama, kv_cache_dtype="fp8", dtype="bfloat16", dense_backend="packed_bf16")
                    .generate(prompts))
    monkeypatch.setenv("KV8_TUNING", "auto")
    monkeypatch.setenv("KV8_CACHE_DIR", os.fspath(tmp_path))
    monkeypatch.setattr("kv8.attention.tuning.streams", lambda lib, case: True)
    seen: list[StreamCase] = []

    def planned(lib: KernelLibrary, cases, plan_threads: int, plans=None, retune=False, measure=None):
        seen.extend(cases)
        return tuned_stream_tiles(lib, cases, plan_threads, plans, retune, measure=clock({6: 0.1}))

    monkeypatch.setattr("kv8.engine.worker.tuned_stream_tiles", planned)
    llm = make_llm(tiny_llama, kv_cache_dtype="fp8", dtype="bfloat16", dense_backend="packed_bf16", block_size=32)
    backend, arch = llm.engine.backend, llm.engine.config.arch
    assert isinstance(backend, FusedCPUBackend) and len(seen) == 1
    assert seen[0].formats == ("fp8_e4m3", "fp8_e4m3") and seen[0].dtype == torch.bfloat16
    assert (seen[0].num_q_heads, seen[0].num_kv_heads, seen[0].head_dim, seen[0].block_size) == \
        (arch.num_heads, arch.num_kv_heads, arch.head_dim, 32) and arch.head_dim != 32
    assert backend.stream_tiles == {("fp8_e4m3", "fp8_e4m3"): 6}
    assert tokens_of(llm.generate(prompts)) == off


def test_kv8_tune_times_the_cache_and_kv8_info_names_the_choice(tiny_llama: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``kv8 tune`` times the stream distance on the model's cache (real passes, made small here; the tiny model's
    head_dim is made one the decode kernels read) and keeps it; ``kv8 info`` then names the kept choice, and says
    what it does where nothing was timed."""
    from kv8.entrypoints.cli import main

    load_or_skip()
    monkeypatch.setenv("KV8_TUNING", "auto")
    monkeypatch.setenv("KV8_CACHE_DIR", os.fspath(tmp_path))
    monkeypatch.setattr("kv8.attention.tuning.TUNE_BATCH", 2)
    monkeypatch.setattr("kv8.attention.tuning.TUNE_CONTEXT", 64)
    monkeypatch.setattr("kv8.attention.tuning.TUNE_FOOTPRINT", 1 << 16)
    flags = ["--dtype", "bfloat16", "--kv-cache-dtype", "int8_per_token_head"]
    assert main(["info", tiny_llama, *flags]) == 0
    assert "decode attention int8_per_token_head: 3 tiles ahead (not a cache the decode kernels read here)" \
        in capsys.readouterr().out
    monkeypatch.setattr("kv8.attention.tuning.streams", lambda lib, case: True)
    assert main(["info", tiny_llama, *flags]) == 0
    assert "int8_per_token_head: not timed on this machine yet" in capsys.readouterr().out
    assert main(["tune", tiny_llama, *flags]) == 0
    out = capsys.readouterr().out
    assert "decode attention on a int8_per_token_head cache, " in out and " x 64 tokens, median of 9 rounds:" in out
    chosen = int(out.split("chosen       streams ")[1].split()[0])
    assert chosen in (3, *STREAM_CANDIDATES)
    (plan,) = (tmp_path / "tuning").glob("*.json")
    assert any(key.startswith("attention/") for key in json.loads(plan.read_text())["plans"])
    assert main(["info", tiny_llama, *flags]) == 0
    assert f"int8_per_token_head: streams {chosen} tiles ahead (this machine's plan, timed " in capsys.readouterr().out
    monkeypatch.setenv("KV8_TUNING", "off")
    assert main(["info", tiny_llama, *flags]) == 0
    assert "int8_per_token_head: 3 tiles ahead (KV8_TUNING=off: the build's default)" in capsys.readouterr().out
