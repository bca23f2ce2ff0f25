"""``kv8 calibrate --plan``: the chooser on synthetic per-layer tables (against brute force), and the search end to
end on a tiny model with one layer made sensitive on purpose.

The sensitive model is the tiny 4-layer ``llama_gqa`` (head_dim 16, 2 KV heads) with layer 2's keys given one large
channel per KV head (its ``k_proj`` rows x30: an outlier that sets every per-token scale, so the other channels
round coarsely) and its values x6, and the other layers' attention outputs damped (``o_proj`` x0.05): quantizing
layer 2 costs far more KLD than quantizing any other layer.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest
import torch

from kv8 import SamplingParams
from kv8.cache.plan import KVSpec, read_plan_file
from kv8.entrypoints.cli import main
from kv8.quant.formats import resolve_kv_cache_dtype
from kv8.tools.evaluate import KVConfig, evaluate
from kv8.tools.plan_choice import SensitivityTable, choose_plan
from kv8.tools.plan_search import (
    DEFAULT_PLAN_FORMATS,
    _Setup,
    causal_attention,
    default_plan_candidates,
    parse_plan_formats,
    read_sensitivity_table,
    search_plan,
    table_record,
    write_plan_file,
)
from tests.helpers.engine import PROMPTS, make_llm, tokens_of
from tests.helpers.tiny_models import make_tiny_model

SENSITIVE = 2
WORDS = "the quick brown fox jumps over lazy dog London is capital of England Paris France".split()


def spec(name: str, rotation: str = "none") -> KVSpec:
    return KVSpec.of(resolve_kv_cache_dtype(name, torch.float32), rotation, "dynamic")


WIDE, MID, NARROW = spec("bfloat16"), spec("int8", "hadamard"), spec("int4", "hadamard")


def table(kld: list[list[float]], byte_counts: tuple[int, ...] = (256, 136, 72),
          candidates: tuple[KVSpec, ...] = (WIDE, MID, NARROW)) -> SensitivityTable:
    return SensitivityTable(candidates, byte_counts, tuple(tuple(r) for r in kld))


def brute_force(t: SensitivityTable) -> list[tuple[int, float, tuple[int, ...]]]:
    """Every plan as (bytes, KLD, choice), in the chooser's order of preference."""
    plans = []
    for choice in itertools.product(range(len(t.candidates)), repeat=t.num_layers):
        plans.append((sum(t.bytes[c] for c in choice), sum(t.kld[i][c] for i, c in enumerate(choice)), choice))
    return plans


def random_table(rng: random.Random, layers: int) -> SensitivityTable:
    rows = []
    for _ in range(layers):
        base = 10 ** rng.uniform(-6, -2)
        rows.append([base * 1e-3, base * rng.uniform(0.01, 0.2), base])   # wider: less KLD
    return table(rows)


@pytest.mark.parametrize("seed", range(6))
def test_the_kld_budget_choice_is_the_cheapest_plan_within_it(seed):
    rng = random.Random(seed)
    t = random_table(rng, 5)
    plans = brute_force(t)
    for budget in sorted(k for _, k, _ in plans)[::40]:
        budget *= 1.0000001   # a budget a plan meets exactly, without float-sum order deciding
        got = choose_plan(t, kld_budget=budget)
        assert got.predicted_kld <= budget
        cheapest = min(b for b, k, _ in plans if k <= budget)
        assert got.bytes_per_token == cheapest
        assert got.predicted_kld == pytest.approx(min(k for b, k, _ in plans if b == cheapest and k <= budget))
        assert got.bytes_per_token == sum(t.bytes[c] for c in got.choice)


@pytest.mark.parametrize("seed", range(6))
def test_the_bytes_budget_choice_is_the_most_accurate_plan_within_it(seed):
    rng = random.Random(100 + seed)
    t = random_table(rng, 5)
    plans = brute_force(t)
    for total in sorted({b for b, _, _ in plans}):
        budget = total + rng.randrange(0, 40)
        got = choose_plan(t, bytes_budget=budget)
        assert got.bytes_per_token <= budget
        assert got.predicted_kld == pytest.approx(min(k for b, k, _ in plans if b <= budget), rel=1e-12)


def test_an_insensitive_layer_goes_narrow_and_a_sensitive_one_stays_wide():
    t = table([[0, 1e-6, 1e-5], [0, 1e-4, 1e-1], [0, 1e-6, 2e-5]])
    got = choose_plan(t, kld_budget=1e-3)
    assert got.specs(t) == (NARROW, MID, NARROW)
    assert got.bytes_per_token == 72 + 136 + 72


def test_ties_go_to_the_first_candidate_and_the_first_layers():
    # two candidates of equal bytes and KLD: the first listed wins, whatever the layer
    twin = spec("int8")
    t = table([[0, 1e-4, 1e-4], [0, 1e-4, 1e-4]], byte_counts=(256, 136, 136), candidates=(WIDE, MID, twin))
    assert choose_plan(t, kld_budget=1e-3).choice == (1, 1)
    # one layer may go narrow, either one costs the same: the first layer's change is preferred (lexicographic)
    t = table([[0, 1e-4, 5e-4], [0, 1e-4, 5e-4]])
    first = choose_plan(t, kld_budget=7e-4)
    assert first.choice == (1, 2) or first.choice == (2, 1)
    assert first == choose_plan(t, kld_budget=7e-4)   # deterministic
    assert first.choice == min((1, 2), (2, 1))


def test_an_impossible_budget_names_the_best_reachable():
    t = table([[1e-4, 1e-3, 1e-2], [2e-4, 1e-3, 1e-2]])
    with pytest.raises(ValueError, match=r"--kld-budget 0.0001 cannot be met: the least KLD these candidates reach "
                                         r"is 0.0003 \(every layer in its most accurate candidate\)"):
        choose_plan(t, kld_budget=1e-4)
    with pytest.raises(ValueError, match=r"--bytes-budget 100 cannot be met: the fewest bytes per token these "
                                         r"candidates reach is 144"):
        choose_plan(t, bytes_budget=100)
    with pytest.raises(ValueError, match="exactly one of kld_budget and bytes_budget"):
        choose_plan(t)


@pytest.mark.parametrize("kwargs,match", [
    (dict(candidates=(WIDE, WIDE)), "distinct candidates"),
    (dict(byte_counts=(256, 0, 72)), "one positive integer per candidate"),
    (dict(kld=[[0, 1e-3, -1e-3]]), "layer 0: needs one finite KLD >= 0 per candidate"),
    (dict(kld=[[0, 1e-3, float("nan")]]), "layer 0: needs one finite KLD >= 0"),
    (dict(kld=[]), "at least one layer"),
])
def test_a_bad_table_is_refused(kwargs, match):
    args = dict(kld=[[0, 1e-3, 1e-2]])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        table(**args)


@pytest.mark.parametrize("names,match", [
    ([], "--plan-formats needs at least one format"),
    (["int3"], r"--plan-formats 'int3': kv_cache_dtype='int3' is not supported"),
    (["int8+givens"], r"--plan-formats 'int8\+givens': rotation='givens' is not supported; choose none, hadamard"),
    (["int8+none/givens"], r"--plan-formats 'int8\+none/givens': rotation='none/givens' is not supported"),
    (["int8", "int8_per_token_head"], "names int8_per_token_head twice"),
])
def test_bad_plan_formats_are_refused(names, match):
    with pytest.raises(ValueError, match=match):
        parse_plan_formats(names, 64, torch.float32)


def test_plan_formats_parse_rotations_and_fp8_keeps_dynamic_scales():
    got = parse_plan_formats(["bf16", "int4+hadamard", "fp8_e4m3", "nvfp4+hadamard", "int4_g32+hadamard"], 64,
                             torch.float32)
    assert [(s.kv_dtype.name, s.rotation, s.dynamic) for s in got] == [
        ("bfloat16", "none", False), ("int4_per_token_head", "hadamard", True), ("fp8_e4m3", "none", True),
        ("fp4_e2m1", "hadamard", False),                     # FP4's scales are in its rows: neither kind
        ("int4_per_group32", "hadamard", False)]             # nor int4 per group's
    assert got[3].token_bytes(64, 2) == got[4].token_bytes(64, 2) == 2 * 2 * (32 + 4)
    with pytest.raises(ValueError, match="--plan-formats 'int4_per_group32': kv_cache_dtype='int4_per_group32' "
                                         "stores a float16 scale per group of 32 values: .* not head_dim=48"):
        parse_plan_formats(["int4_per_group32"], 48, torch.float32)
    with pytest.raises(ValueError, match="hadamard rotation needs a power-of-two head_dim; this model's is 24"):
        parse_plan_formats(["int8+hadamard"], 24, torch.float32)


def test_plan_formats_take_kv_pairs_and_their_table_reads_back(tmp_path):
    """A K/V pair is a candidate like any format (its bytes are each side's); the recorded table and the plan file
    name it as kv_cache_dtype does."""
    got = parse_plan_formats(["k8v4+hadamard", "fp8/int4_g32", "int8"], 64, torch.float32)
    assert [(s.name, s.rotation, s.dynamic) for s in got] == [
        ("int8_per_token_head/int4_per_group32", "hadamard", True), ("fp8_e4m3/int4_per_group32", "none", True),
        ("int8_per_token_head", "none", True)]
    assert got[0].token_bytes(64, 2) == 2 * (68 + 36)
    table = SensitivityTable(got, tuple(s.token_bytes(64, 2) for s in got), ((1e-3, 2e-3, 5e-4),))
    path = tmp_path / "plan.json"
    write_plan_file(path, [got[0]], {"table": table_record(table)})
    assert read_sensitivity_table(str(path)).candidates == got
    assert [e.kv_cache_dtype for e in read_plan_file(path).entries] == ["int8_per_token_head/int4_per_group32"]
    with pytest.raises(ValueError, match="--plan-formats 'int8/int4_g32': kv_cache_dtype='int4_per_group32' "
                                         "stores a float16 scale per group of 32 values"):
        parse_plan_formats(["int8/int4_g32"], 48, torch.float32)


@pytest.mark.parametrize("head_dim, dropped", [
    (64, ()), (256, ()),
    (16, ("k8v4+hadamard", "k8v4")),                          # k8v4's values are scaled per 32
    (96, ("int8_per_token_head+hadamard", "k8v4+hadamard", "int4_per_token_head+hadamard")),   # no Hadamard at 96
    (48, ("int8_per_token_head+hadamard", "k8v4+hadamard", "k8v4", "int4_per_token_head+hadamard")),
])
def test_the_default_candidates_are_those_the_head_size_allows(head_dim, dropped):
    """Every default candidate a head size allows, in the default order; the others named (a user's
    --plan-formats naming one is refused instead: test_plan_formats_parse_rotations_and_fp8_keeps_dynamic_scales)."""
    kept, got = default_plan_candidates(head_dim, torch.float32)
    assert got == dropped
    names = [n for n in DEFAULT_PLAN_FORMATS if n not in dropped]
    assert kept == tuple(parse_plan_formats(names, head_dim, torch.float32))
    assert len(kept) + len(dropped) == len(DEFAULT_PLAN_FORMATS) == 7
    if not dropped:   # the K/V pair is a default candidate: int8 keys, 4-bit values per group of 32, rotated or not
        assert [(s.name, s.rotation) for s in kept if s.v_dtype is not None] == [
            ("int8_per_token_head/int4_per_group32", "hadamard"), ("int8_per_token_head/int4_per_group32", "none")]


def test_causal_attention_matches_torch_sdpa():
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 4, 8, dtype=torch.float64), torch.randn(7, 2, 8, dtype=torch.float64), torch.randn(
        7, 2, 8, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True, scale=0.3).transpose(0, 1)
    torch.testing.assert_close(causal_attention(q, k, v, 0.3, None), want)


def test_a_plan_table_must_come_from_a_plan_search(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"kv8_kv_plan": 1, "layers": {}}))
    with pytest.raises(ValueError, match="records no sensitivity table"):
        read_sensitivity_table(str(path))
    path.write_text(json.dumps({"kv8_kv_plan": 1, "layers": {}, "calibration": {"table": {"candidates": []}}}))
    with pytest.raises(ValueError, match="its calibration.table is malformed"):
        read_sensitivity_table(str(path))


def test_a_plan_file_may_carry_a_calibration_record(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"kv8_kv_plan": 1, "layers": {"0": {"kv_cache_dtype": "int8"}},
                                "calibration": {"measured_kld": 1e-3}}))
    assert [e.kv_cache_dtype for e in read_plan_file(path).entries] == ["int8"]
    path.write_text(json.dumps({"kv8_kv_plan": 1, "layers": {}, "calibration": 3}))
    with pytest.raises(ValueError, match="calibration must be an object"):
        read_plan_file(path)


@pytest.fixture(scope="module")
def sensitive(tmp_path_factory) -> tuple[str, str]:
    """(model dir, text file): the tiny model with layer SENSITIVE made sensitive (module docstring)."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(str(tmp_path_factory.mktemp("sensitive")), "llama_gqa", num_hidden_layers=4)
    w = load_file(f"{path}/model.safetensors")
    for i in range(4):
        if i == SENSITIVE:
            k = w[f"model.layers.{i}.self_attn.k_proj.weight"]   # [Hkv * D, hidden]
            for head in range(2):
                k[head * 16 + 3] *= 30.0
            w[f"model.layers.{i}.self_attn.v_proj.weight"] *= 6.0
        else:
            w[f"model.layers.{i}.self_attn.o_proj.weight"] *= 0.05
    save_file(w, f"{path}/model.safetensors", metadata={"format": "pt"})
    rng = random.Random(0)
    text = tmp_path_factory.mktemp("text") / "t.txt"
    text.write_text(" ".join(rng.choice(WORDS) for _ in range(3000)))
    return path, str(text)


def test_the_search_keeps_the_sensitive_layer_wide_and_its_file_serves_it(sensitive, tmp_path):
    model, text = sensitive
    out = tmp_path / "plan.json"
    lines: list[str] = []
    assert main(["calibrate", model, "--data", text, "--plan", "--kld-budget", "3e-3", "--seq-len", "64",
                 "--dtype", "float32", "-o", str(out)]) == 0
    result = search_plan(model, [text], kld_budget=3e-3, seq_len=64, dtype="float32", progress=lines.append)
    assert any("held-out windows" in line for line in lines)
    assert "default candidates without k8v4+hadamard, k8v4: head_dim 16 does not allow them" in lines
    specs = result.specs
    widths = [s.token_bytes(16, 2) for s in specs]
    others = [w for i, w in enumerate(widths) if i != SENSITIVE]
    assert widths[SENSITIVE] > max(others)
    assert all(s.kv_dtype.name == "int4_per_token_head" for i, s in enumerate(specs) if i != SENSITIVE)
    assert result.measured_kld <= 3e-3
    # the layer's own table row: its narrowest candidate costs more than the whole budget
    assert min(result.table.kld[SENSITIVE][3:]) > 3e-3
    data = json.loads(out.read_text())
    assert data["calibration"]["kld_budget"] == 3e-3 and data["calibration"]["measured_kld"] <= 3e-3
    assert {int(k): (v["kv_cache_dtype"], v["kv_cache_rotation"]) for k, v in data["layers"].items()} == {
        i: (s.kv_dtype.name, s.rotation) for i, s in enumerate(specs)}
    # the recorded table chooses the same plan again without measuring (and is checked against the model)
    lines.clear()
    again = search_plan(model, [text], kld_budget=3e-3, seq_len=64, dtype="float32", table=read_sensitivity_table(
        str(out)), progress=lines.append)
    assert again.specs == specs and again.table == result.table and len(lines) == 1   # only the check's line
    with pytest.raises(ValueError, match="--plan-table: its table has 4 layers .* a table of another model"):
        search_plan(make_tiny_model(str(tmp_path / "six"), "llama_gqa", num_hidden_layers=6), [text], kld_budget=3e-3,
                    seq_len=64, table=result.table)
    # kv8 eval with the file on the held-out windows the search checked it on (the 2 after its 2 calibration windows)
    # measures what the search measured
    report = evaluate(model, [text], [KVConfig("float32", kv_cache_plan=str(out))], window=64, num_windows=2,
                      skip_tokens=2 * 64, gen_prompts=1, gen_prompt_len=8, gen_tokens=4, dtype="float32",
                      attention_backend="auto", show_progress=False)
    assert report.results[0].label == f"float32+plan:{out}"
    assert report.results[0].bytes_per_token == result.choice.bytes_per_token
    assert report.results[0].mean_kld == pytest.approx(result.measured_kld, rel=1e-9)
    # the file serves: the same greedy tokens as the same formats set by hand in a plan without a record
    by_hand = tmp_path / "hand.json"
    by_hand.write_text(json.dumps({"kv8_kv_plan": 1, "layers": {
        str(i): {"kv_cache_dtype": s.kv_dtype.name, "kv_cache_rotation": s.rotation} for i, s in enumerate(specs)}}))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    written = make_llm(model, kv_cache_dtype="bfloat16", kv_cache_plan=str(out))
    hand = make_llm(model, kv_cache_dtype="float16", kv_cache_plan=str(by_hand))
    assert tokens_of(written.generate(PROMPTS[:3], greedy)) == tokens_of(hand.generate(PROMPTS[:3], greedy))
    assert [c.kv_dtype.name for c in written.engine.caches] == [c.kv_dtype.name for c in hand.engine.caches]


def test_a_plan_measured_above_the_budget_is_replaced_or_refused(sensitive, monkeypatch):
    """The check's measurement replaced by ``factor`` x the budget: each retry chooses a plan predicted below the
    rejected one's prediction / factor; the search refuses once retries run out, or no plan can be predicted that
    low."""
    model, text = sensitive
    budget = 3e-3
    table = search_plan(model, [text], kld_budget=budget, seq_len=64, dtype="float32",
                        progress=lambda line: None).table
    real = _Setup.measure
    factor = 1.5

    def above_budget(self, meter, specs):
        kld = real(self, meter, specs)   # the engine still runs
        return budget * factor if len(specs) == 4 and kld >= 0 else kld   # a whole plan: the check

    monkeypatch.setattr(_Setup, "measure", above_budget)
    first = choose_plan(table, kld_budget=budget)
    with pytest.raises(ValueError, match=rf"after 0 tightenings the plans measured 0.0045 \(predicted "
                                         rf"{first.predicted_kld:.3g}\)"):
        search_plan(model, [text], kld_budget=budget, seq_len=64, dtype="float32", table=table, retries=0,
                    progress=lambda line: None)
    lines: list[str] = []
    with pytest.raises(ValueError, match=r"after 1 tightenings the plans measured 0.0045, 0.0045 \(predicted "):
        search_plan(model, [text], kld_budget=budget, seq_len=64, dtype="float32", table=table, retries=1,
                    progress=lines.append)
    second = choose_plan(table, kld_budget=first.predicted_kld / factor)
    assert second.predicted_kld < first.predicted_kld / factor and second.bytes_per_token > first.bytes_per_token
    assert [line for line in lines if line.startswith("plan:")] == [
        f"plan: {c.bytes_per_token} bytes per token, predicted KLD {c.predicted_kld:.3g}, measured 0.0045 on 2 "
        "held-out windows" for c in (first, second)]
    factor = 1e6
    with pytest.raises(ValueError, match=r"cannot be met: the plan predicted at .* would be needed, and the least KLD "
                                         r"these candidates reach is"):
        search_plan(model, [text], kld_budget=budget, seq_len=64, dtype="float32", table=table, retries=5,
                    progress=lambda line: None)


def test_an_impossible_budget_end_to_end_names_the_best_kld(sensitive):
    model, text = sensitive
    with pytest.raises(ValueError, match=r"--kld-budget 1e-12 cannot be met: the least KLD these candidates reach is "
                                         r"[0-9.e-]+ \(every layer in its most accurate candidate\)"):
        search_plan(model, [text], kld_budget=1e-12, seq_len=64, dtype="float32", formats=["int8", "int4"],
                    progress=lambda line: None)


@pytest.mark.parametrize("argv,match", [
    (["--kld-budget", "1e-3", "-o", "x.json"], "--kld-budget sets a per-layer plan's budget; give --plan with it"),
    (["--plan", "-o", "x.json"], "--plan needs exactly one of --kld-budget NATS and --bytes-budget"),
    (["--plan", "--kld-budget", "1e-3"], "--plan writes a plan file: give --output PATH"),
    (["--plan", "--kld-budget", "1e-3", "--bytes-budget", "100", "-o", "x.json"], "exactly one of"),
    (["--plan", "--kld-budget", "1e-3", "-o", "x.json", "--kv-cache-rotation", "hadamard"],
     "--kv-cache-rotation does not apply to --plan"),
])
def test_calibrate_plan_flags_are_checked(sensitive, argv, match, capsys):
    model, text = sensitive
    assert main(["calibrate", model, "--data", text, *argv]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_a_bytes_budget_by_format_name(sensitive, tmp_path, capsys):
    model, text = sensitive
    out = tmp_path / "plan.json"
    assert main(["calibrate", model, "--data", text, "--plan", "--bytes-budget", "fp8_e4m3", "--seq-len", "64",
                 "--dtype", "float32", "--plan-formats", "bfloat16", "int8+hadamard", "int4+hadamard",
                 "--no-progress", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    # fp8_e4m3 with static scales: 4 layers x K and V x 2 heads x 16 values x 1 byte
    assert "--bytes-budget fp8_e4m3: 256 bytes per token" in printed
    data = json.loads(out.read_text())
    assert data["calibration"]["bytes_per_token"] <= 256
    assert data["layers"][str(SENSITIVE)]["kv_cache_dtype"] != "int4_per_token_head"
    assert Path(out).exists()
