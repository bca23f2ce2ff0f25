"""The thread governor (kv8.engine.threads): the cores other processes leave free, read from /proc/stat."""

from __future__ import annotations

from pathlib import Path

import pytest

from kv8.cpu_load import CpuClock, read_cpu_clock
from kv8.engine.threads import ThreadGovernor

pytestmark = pytest.mark.adaptive_threads


class FakeMachine:
    """A clock over 2 CPUs where other processes take ``others`` cores and kv8 ``own`` cores, per second."""

    def __init__(self) -> None:
        self.t, self.busy, self.own = 0.0, 0.0, 0.0
        self.others, self.own_rate = 0.0, 2.0
        self.reads = 0

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.own += self.own_rate * seconds
        self.busy += (self.own_rate + self.others) * seconds

    def clock(self, cpus: frozenset[int]) -> CpuClock:
        self.reads += 1
        return CpuClock(self.t, self.busy, self.own)


def governor(machine: FakeMachine, max_threads: int = 2) -> tuple[ThreadGovernor, list[int]]:
    calls: list[int] = []
    gov = ThreadGovernor(max_threads, window=0.25, cpus=frozenset({0, 1}), clock=machine.clock,
                         set_threads=calls.append, now=lambda: machine.t)
    return gov, calls


def test_fewer_threads_at_once_more_after_two_quiet_windows() -> None:
    m = FakeMachine()
    gov, calls = governor(m)
    assert gov.observe() == 2 and calls == []            # the first reading: nothing to compare with
    m.advance(0.3)
    assert gov.observe() == 2 and calls == []            # idle: stays
    m.others, m.own_rate = 1.0, 1.0                       # a busy process takes a core
    m.advance(0.3)
    assert gov.observe() == 1 and calls == [1]            # down at once
    m.advance(0.1)
    assert gov.observe() == 1 and m.reads == 3            # within the window: /proc/stat is not read
    m.others = 0.0                                        # the load left
    m.advance(0.3)
    assert gov.observe() == 1                             # one quiet window is not enough
    m.advance(0.3)
    assert gov.observe() == 2 and calls == [1, 2]         # the second one brings the threads back
    m.others = 0.3                                        # a light load leaves 1.7 cores: keep 2
    for _ in range(3):
        m.advance(0.3)
        assert gov.observe() == 2
    assert calls == [1, 2]


def test_a_window_that_spans_an_idle_engine_decides_nothing() -> None:
    """Other processes busy while the engine idles (between requests, or paused by a benchmark) and gone when it
    steps again: the first step keeps its threads; only windows in which the engine stepped count."""
    m = FakeMachine()
    gov, calls = governor(m)
    gov.idle()                                            # the engine is built: the first reading
    assert m.reads == 1
    m.advance(0.5)
    gov.observe()                                         # a step
    m.advance(0.1)
    gov.idle()
    m.others, m.own_rate = 2.0, 0.0                       # the engine idles for a minute beside a busy job
    m.advance(60.0)
    m.others, m.own_rate = 0.0, 2.0                       # the job ended; a burst arrives
    assert gov.observe() == 2 and calls == []             # not a window: a new start
    m.advance(0.3)
    assert gov.observe() == 2 and calls == []
    # a load that is really there is still seen within one window of stepping
    m.others, m.own_rate = 2.0, 0.5
    m.advance(0.3)
    assert gov.observe() == 1 and calls == [1]
    # idle gaps up to idle_gap between steps still decide: the load left, and two windows bring the threads back
    m.others, m.own_rate = 0.0, 2.0
    for _ in range(2):
        m.advance(0.2)
        gov.idle()
        m.advance(0.8)
        gov.observe()
    assert calls == [1, 2]


def test_steps_longer_than_the_idle_gap_still_decide() -> None:
    """Beside a busy process per core, steps whose spinning threads wait for parked ones take seconds each; a
    window made of such steps is a stepping window, not an idle one, and the threads go down after it."""
    m = FakeMachine()
    gov, calls = governor(m)
    gov.idle()
    m.advance(0.01)
    m.others, m.own_rate = 1.2, 0.8                       # two busy processes share the cores with kv8's threads
    assert gov.observe() == 2                             # a step starts right after the engine was built
    m.advance(3.0)                                        # ... and takes 3 s
    gov.idle()
    m.advance(0.001)
    assert gov.observe() == 1 and calls == [1]


def test_bounds_and_what_is_counted() -> None:
    m = FakeMachine()
    gov, calls = governor(m, max_threads=1)
    m.others = 0.0
    for _ in range(3):
        m.advance(0.3)
        gov.observe()
    assert gov.threads == 1 and calls == []               # never above the configured count
    assert gov.target(5.0) == 1 and gov.target(-1.0) == 1
    wide = ThreadGovernor(8, cpus=frozenset(range(8)), clock=m.clock, set_threads=calls.append, now=lambda: m.t)
    assert [wide.target(x) for x in (0.0, 0.4, 2.6, 7.9)] == [8, 8, 5, 1]
    # kv8's own CPU time is not the others': kv8 alone, however busy, sees the cores free
    assert gov.others(CpuClock(0.0, 10.0, 5.0), CpuClock(1.0, 12.0, 7.0)) == 0.0
    assert gov.others(CpuClock(0.0, 10.0, 5.0), CpuClock(1.0, 12.0, 6.0)) == pytest.approx(1.0)


def test_no_proc_stat_leaves_the_threads_alone() -> None:
    calls: list[int] = []
    t = [0.0]
    gov = ThreadGovernor(2, clock=lambda cpus: None, set_threads=calls.append, now=lambda: t[0])
    for _ in range(4):
        t[0] += 1.0
        assert gov.observe() == 2
    assert calls == []
    with pytest.raises(ValueError, match="max_threads=0 must be >= 1"):
        ThreadGovernor(0)


def test_read_cpu_clock_sums_the_given_cpus(tmp_path: Path) -> None:
    import os

    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text("cpu  900 0 900 9000 0 0 0 0 0 0\n"
                    "cpu0 100 1 10 5000 7 2 3 4 0 0\n"           # busy: user nice system irq softirq steal
                    "cpu1 200 0 20 4000 0 0 0 6 0 0\n"
                    "cpu2 999 0 999 0 0 0 0 0 0 0\n"
                    "intr 12345\n")
    clock = read_cpu_clock(frozenset({0, 1}), str(stat))
    assert clock is not None and clock.busy == pytest.approx((100 + 1 + 10 + 2 + 3 + 4 + 200 + 20 + 6) / hz)
    assert read_cpu_clock(frozenset({0, 5}), str(stat)) is None          # a CPU the file does not list
    assert read_cpu_clock(frozenset({0}), str(tmp_path / "missing")) is None
    assert read_cpu_clock(frozenset(os.sched_getaffinity(0))) is not None   # this machine's


def test_engine_option(tiny_llama: str) -> None:
    import torch

    from kv8 import LLM

    threads = torch.get_num_threads()
    assert LLM(tiny_llama, dtype="float32", num_kv_blocks=16, max_model_len=64).engine.governor is not None
    fixed = LLM(tiny_llama, dtype="float32", num_kv_blocks=16, max_model_len=64, adaptive_cpu_threads=False)
    assert fixed.engine.governor is None and torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="adaptive_cpu_threads='yes' must be True or False"):
        LLM(tiny_llama, dtype="float32", num_kv_blocks=16, max_model_len=64, adaptive_cpu_threads="yes")


@pytest.fixture
def two_threads():
    """Runs the test at torch.set_num_threads(2) (what the governor lowers from), restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kv_name", ["fp8_e4m3", "bfloat16"])
def test_attention_bits_depend_on_the_plan_not_on_the_running_threads(kv_name: str, two_threads: None) -> None:
    """kv8's attention splits its work for ``plan_threads`` (the engine's start-up count) and gives the same bits on
    any number of running threads, so lowering the threads under load changes no output. A decode-heavy batch with
    long contexts, where the plan splits contexts into partitions."""
    import torch

    from kv8.kernels.cpu.attention import paged_attention_fused
    from tests.helpers.kernels import load_or_skip, make_case

    lib = load_or_skip()
    cache, meta, q = make_case(kv_name, "tensor", torch.bfloat16, query_lens=[1, 1], seq_lens=[1500, 1700])
    scale = q.shape[-1] ** -0.5
    with_two = paged_attention_fused(lib, q, cache, 1, meta, scale, plan_threads=2)
    torch.set_num_threads(1)
    with_one = paged_attention_fused(lib, q, cache, 1, meta, scale, plan_threads=2)
    assert torch.equal(with_one, with_two)
    # on the fast path the plan itself moves bits here (other partitions, another log-sum-exp combine): planning for
    # the running threads would have changed the output when the governor lowered them (the generic path of CPUs
    # without AVX-512 splits no context, so its plans agree bit for bit)
    if lib.has_fast_path:
        assert not torch.equal(paged_attention_fused(lib, q, cache, 1, meta, scale, plan_threads=1), with_two)
    with pytest.raises(ValueError, match="plan_threads=0 must be an int >= 1 \\(or None\\)"):
        paged_attention_fused(lib, q, cache, 1, meta, scale, plan_threads=0)


def test_dense_kernel_bits_do_not_depend_on_the_threads(two_threads: None) -> None:
    import torch

    from kv8.kernels.cpu.build import KernelUnavailable
    from kv8.kernels.cpu.dense import load_dense_kernels

    try:
        dense = load_dense_kernels()
    except KernelUnavailable as exc:
        pytest.skip(f"dense kernels unavailable: {exc}")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=gen).to(torch.bfloat16)
    codes = torch.randint(0, 126, (1536, 576), dtype=torch.uint8, generator=gen)
    packed, packed_fp8 = dense.pack(weight), dense.pack_fp8(codes)
    scale = torch.rand(1536, generator=gen) / 100
    for rows in (1, 8, 32, 300):
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        results = []
        for threads in (2, 1):
            torch.set_num_threads(threads)
            results.append((dense.linear(x, packed, 1536, None), dense.linear(x, packed_fp8, 1536, None, scale=scale)))
        torch.set_num_threads(2)
        for a, b in zip(*results):
            assert torch.equal(a, b), rows


def test_an_engine_whose_threads_drop_mid_run_gives_the_same_tokens(tiny_llama: str, two_threads: None) -> None:
    """bf16 on kv8's kernels (the default on AVX-512 BF16 machines): the same greedy tokens and logprobs when the
    threads go from 2 to 1 between steps as at 2 throughout."""
    import torch

    from kv8 import LLM, SamplingParams

    llm = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=64, max_model_len=256, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = ["The quick brown fox jumps over the lazy dog. London is", "Paris is the capital of"] * 2

    def run() -> list:
        out = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in p.items()} for p in o.outputs[0].logprobs])
                for o in out]

    at_two = run()
    step = llm.engine.step

    def step_then_drop() -> list:   # the governor's move: one thread from the next step on
        outs = step()
        torch.set_num_threads(1)
        return outs

    llm.engine.step = step_then_drop   # type: ignore[method-assign]
    assert run() == at_two
