"""The GGUF int8 kernel's path for one-row calls chosen per machine (kv8.layers.tuning.tuned_gguf_paths): per block
type of the decoder and for the LM head alone, on a fake clock; kept in the plan file and read back; timed again for
another build; left to the user where ``$KV8_GGUF_KERNEL`` names a path; and every layer runs the path its group
chose, with the same bits on every path (the real kernels). Timing itself stays in benchmarks (kv8 tune,
bench_engine_step.py --gguf-paths)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kv8.layers.dense_backend import DenseBackend
from kv8.layers.linear import GGUFLinearMethod, gguf_segment, linear_method
from kv8.layers.tuning import (
    GGUF_PATH_MIN_GAIN,
    HEAD_GROUP,
    LinearShape,
    PlanStore,
    choose_gguf_path,
    gguf_path_groups,
    stored_gguf_path,
    tuned_gguf_paths,
)
from kv8.layers.vocab_parallel import ParallelLMHead
from kv8.quant.gguf_blocks import random_blocks
from tests.helpers.kernels import dense_build_or_skip

MACHINE = {"cpu": "test cpu", "isa": "avx2", "kv8": "0", "torch": "0", "threads": "2"}
SHAPES = [LinearShape(640, 2048, 9, qtype="Q4_K"), LinearShape(640, 2048, 9, qtype="Q6_K"),
          LinearShape(256, 640, 9, qtype="Q8_0"), LinearShape(1536, 640, 9, qtype="Q5_K"),
          LinearShape(4096, 640, 1, qtype="Q8_0", lm_head=True)]


class FakeKernels:
    """What the path tuner reads of kv8's dense kernels: the types and paths they have, the default, the build."""

    gguf_types = ("Q4_K", "Q6_K", "Q8_0")
    gguf_paths = {"avx2": 0, "vnni256": 1, "vnni512": 2}
    gguf_path = "vnni512"
    path = Path("/cache/kernels/dense-abc.so")


FAKE = FakeKernels()


def backend_of(kernels: object = None, **kw) -> DenseBackend:
    return DenseBackend("packed_bf16", kernels or FAKE, "gguf", **kw)   # type: ignore[arg-type]


def clock(fast: dict[str, str], calls: list | None = None):
    """``measure(path, shape, rows)``: 1.0 for the path ``fast`` names for the shape's group (its type, or lm_head),
    2.0 for the others (the default path where the group is not named)."""
    def measure(path: str, shape: LinearShape, rows: int) -> float:
        if calls is not None:
            calls.append((path, shape, rows))
        group = HEAD_GROUP if shape.lm_head else shape.qtype
        return 1.0 if path == fast.get(group or "", "vnni512") else 2.0
    return measure


def test_groups_are_the_decoders_types_and_the_lm_head_alone() -> None:
    groups = gguf_path_groups(SHAPES, FakeKernels.gguf_types)
    assert list(groups) == ["Q4_K", "Q6_K", "Q8_0", HEAD_GROUP]   # Q5_K: no kernel; the head last
    assert groups["Q8_0"] == [SHAPES[2]] and groups[HEAD_GROUP] == [SHAPES[4]]


def test_the_fastest_path_at_one_row_wins_only_by_the_margin() -> None:
    members = [SHAPES[0], LinearShape(2048, 640, 9, qtype="Q4_K")]
    calls: list = []
    choice, seconds = choose_gguf_path(["avx2", "vnni256", "vnni512"], "vnni512", members,
                                       clock({"Q4_K": "vnni256"}, calls), rounds=2)
    assert choice == "vnni256" and seconds["vnni256"] == {1: 18.0} and seconds["vnni512"] == {1: 36.0}
    assert sorted({(p, r) for p, _, r in calls}) == [(p, 1) for p in ("avx2", "vnni256", "vnni512")]
    assert len(calls) == 2 * 2 * 3 and calls[0][0] == "vnni512" and calls[6][0] != "vnni512"   # rotated each round
    close = lambda path, shape, rows: 1.0 if path == "vnni512" else 1.0 - GGUF_PATH_MIN_GAIN / 2  # noqa: E731
    assert choose_gguf_path(["avx2", "vnni512"], "vnni512", members, close)[0] == "vnni512"
    with pytest.raises(ValueError, match="rounds=0"):
        choose_gguf_path(["avx2"], "avx2", members, close, rounds=0)


def test_each_group_gets_its_path_kept_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kv8.layers.tuning.read_cpu_clock", lambda cpus: None)
    monkeypatch.delenv("KV8_GGUF_KERNEL", raising=False)
    store, calls = PlanStore(tmp_path, MACHINE), []
    fast = {"Q4_K": "vnni256", HEAD_GROUP: "avx2"}
    backend, results = tuned_gguf_paths(backend_of(), SHAPES, torch.bfloat16, store, clock(fast, calls))
    assert {g: r.choice for g, r in results.items()} == {"Q4_K": "vnni256", "Q6_K": "vnni512", "Q8_0": "vnni512",
                                                         HEAD_GROUP: "avx2"}
    assert backend.gguf_kernel_paths == (("Q4_K", "vnni256"),) and backend.gguf_head_path == "avx2"
    assert backend.label == "packed_bf16{Q4_K:vnni256,lm_head:avx2}"
    assert results[HEAD_GROUP].speedup(1) == 2.0 and "<- chosen" in results[HEAD_GROUP].table()
    kept = json.loads(store.path.read_text())["plans"]
    assert len([k for k in kept if k.startswith("gguf_path/")]) == 4
    kernels = FakeKernels()
    head = stored_gguf_path(store, [SHAPES[4]], torch.bfloat16, HEAD_GROUP, kernels)   # type: ignore[arg-type]
    assert head is not None and head.choice == "avx2"
    timed = len(calls)
    again, _ = tuned_gguf_paths(backend_of(), SHAPES, torch.bfloat16, store, clock({}, calls))
    assert again == backend and len(calls) == timed   # read, not timed
    retuned, _ = tuned_gguf_paths(backend_of(), SHAPES, torch.bfloat16, store, clock({}, calls), retune=True)
    assert retuned.gguf_kernel_paths == () and retuned.gguf_head_path == "" and len(calls) > timed
    # another build of the kernels: its paths are timed again
    other = FakeKernels()
    other.path = Path("/cache/kernels/dense-def.so")   # type: ignore[misc]
    assert stored_gguf_path(store, [SHAPES[4]], torch.bfloat16, HEAD_GROUP, other) is None   # type: ignore[arg-type]
    rebuilt, _ = tuned_gguf_paths(backend_of(other), SHAPES, torch.bfloat16, store, clock(fast))
    assert rebuilt.gguf_head_path == "avx2"


def test_nothing_is_timed_where_there_is_no_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, calls = PlanStore(tmp_path, MACHINE), []
    monkeypatch.setenv("KV8_GGUF_KERNEL", "avx2")   # the user's path
    assert tuned_gguf_paths(backend_of(), SHAPES, torch.bfloat16, store, clock({}, calls)) == (backend_of(), {})
    monkeypatch.delenv("KV8_GGUF_KERNEL")
    fp8 = DenseBackend("packed_bf16", FakeKernels(), "fp8")   # type: ignore[arg-type]
    assert tuned_gguf_paths(fp8, SHAPES, torch.bfloat16, store, clock({}, calls)) == (fp8, {})
    one = FakeKernels()
    one.gguf_paths = {"avx2": 0}   # type: ignore[misc]
    assert tuned_gguf_paths(backend_of(one), SHAPES, torch.bfloat16, store, clock({}, calls))[1] == {}
    assert not calls and not store.path.exists()


def test_layers_run_their_groups_path_with_the_same_bits() -> None:
    """The real kernels: a layer's one-row calls run the path of their type, the LM head's its own, calls of more rows
    the kernels' default, and every path gives the same output bits; a path the build lacks is refused, naming the
    ones it has."""
    kernels = dense_build_or_skip("native")
    if "Q8_0" not in kernels.gguf_types or len(kernels.gguf_paths) < 2:
        pytest.skip(f"this build's GGUF kernel has paths {list(kernels.gguf_paths)}")
    paths = list(kernels.gguf_paths)
    segment = gguf_segment([random_blocks("Q8_0", 64, 256, torch.Generator().manual_seed(0))], 256, kernels)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    outs = {p: kernels.gguf_linear(x, segment.blocks, "Q8_0", 64, None, p) for p in paths}
    assert all(torch.equal(out, outs[paths[0]]) for out in outs.values())
    with pytest.raises(ValueError, match="not in this build; it has"):
        kernels.gguf_linear(x, segment.blocks, "Q8_0", 64, None, "sse2")
    seen: list[str | None] = []
    real = kernels.gguf_linear

    class Spy:
        """The kernels with gguf_linear recording the path it is asked for."""

        def __getattr__(self, name: str):
            return getattr(kernels, name)

        def gguf_linear(self, *args, **kw):
            seen.append(args[5] if len(args) > 5 else kw.get("path"))
            return real(*args, **kw)

    spy = Spy()
    backend = DenseBackend("packed_bf16", spy, "gguf", gguf_kernel_paths=(("Q8_0", paths[0]),),   # type: ignore[arg-type]
                           gguf_head_path=paths[-1])
    method = linear_method(backend)
    assert isinstance(method, GGUFLinearMethod) and method.type_paths == {"Q8_0": paths[0]} and method.path is None
    method._apply_segment(segment, x[:1], None)
    head = GGUFLinearMethod(spy, 0, path=backend.gguf_head_path)   # type: ignore[arg-type]
    head._apply_segment(segment, x[:1], None)
    method._apply_segment(segment, x, None)   # more rows than one: the kernels' default
    head._apply_segment(segment, x, None)
    assert seen == [paths[0], paths[-1], None, None]
    lm_head = ParallelLMHead(256, 64, backend)
    assert isinstance(lm_head.method, GGUFLinearMethod) and lm_head.method.path == paths[-1]
