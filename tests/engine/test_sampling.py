"""Tests for kv8.sampling_params.SamplingParams and kv8.engine.sampler."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kv8.engine.sampler import (
    SamplerOutput,
    TokenHistory,
    apply_penalties,
    argmax_reference,
    compute_logprobs,
    make_generator,
    sample,
    select_argmax,
)
from kv8.sampling_params import SamplingParams, SamplingType


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _draw(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent samples of one row: a batch of n copies, each row with its own generator."""
    logits = logits_row.unsqueeze(0).expand(n, -1)
    gens = [_gen(seed * 100_003 + i) for i in range(n)]
    return sample(logits, [params] * n, gens).token_ids


# --------------------------------------------------------------------------- SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (False, False, True)
    assert (p.logprobs, p.prompt_logprobs) == (None, None)
    assert p.sampling_type is SamplingType.RANDOM


GOOD_VALUES: list[tuple[str, object, object]] = [
    # (field, given, stored)
    ("n", 1, 1),
    ("n", 4, 4),
    ("temperature", 0, 0.0),
    ("temperature", 0.7, 0.7),
    ("temperature", 2, 2.0),
    ("top_p", 1.0, 1.0),
    ("top_p", 1e-9, 1e-9),
    ("top_k", 0, 0),
    ("top_k", -1, -1),
    ("top_k", 1, 1),
    ("top_k", 50, 50),
    ("min_p", 0.0, 0.0),
    ("min_p", 1, 1.0),
    ("min_p", 0.05, 0.05),
    ("seed", None, None),
    ("seed", 0, 0),
    ("seed", -5, -5),
    ("seed", 2**64 - 1, 2**64 - 1),
    ("max_tokens", None, None),
    ("max_tokens", 1, 1),
    ("max_tokens", 4096, 4096),
    ("min_tokens", 0, 0),
    ("min_tokens", 16, 16),
    ("stop", None, []),
    ("stop", "###", ["###"]),
    ("stop", ["a", "bc"], ["a", "bc"]),
    ("stop", ("x",), ["x"]),
    ("stop", [], []),
    ("stop_token_ids", None, []),
    ("stop_token_ids", [0, 2], [0, 2]),
    ("stop_token_ids", (7,), [7]),
    ("ignore_eos", True, True),
    ("include_stop_str_in_output", True, True),
    ("logprobs", None, None),
    ("logprobs", 0, 0),
    ("logprobs", 5, 5),
    ("prompt_logprobs", None, None),
    ("prompt_logprobs", 0, 0),
    ("prompt_logprobs", 3, 3),
    ("skip_special_tokens", False, False),
    ("presence_penalty", -2, -2.0),
    ("presence_penalty", 1.5, 1.5),
    ("frequency_penalty", 2, 2.0),
    ("repetition_penalty", 1, 1.0),
    ("repetition_penalty", 1.3, 1.3),
    ("logit_bias", None, None),
    ("logit_bias", {}, None),
    ("logit_bias", {5: 100, 0: -100.0}, {5: 100.0, 0: -100.0}),
]


@pytest.mark.parametrize(("field", "given", "stored"), GOOD_VALUES)
def test_good_values_are_accepted_and_normalised(field: str, given: object, stored: object) -> None:
    p = SamplingParams(**{field: given})
    value = getattr(p, field)
    assert value == stored
    assert type(value) is type(stored)


BAD_VALUES: list[tuple[str, object]] = [
    ("n", 0),
    ("n", -1),
    ("n", 1.0),
    ("n", True),
    ("n", "2"),
    ("temperature", -0.1),
    ("temperature", "hot"),
    ("temperature", True),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", float("nan")),
    ("top_p", False),
    ("top_p", "0.9"),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", True),
    ("top_k", None),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", float("nan")),
    ("min_p", True),
    ("seed", 1.5),
    ("seed", True),
    ("seed", "42"),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 10.0),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", 1.0),
    ("min_tokens", None),
    ("min_tokens", False),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop", {"a"}),
    ("stop_token_ids", 3),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", "12"),
    ("ignore_eos", 1),
    ("ignore_eos", None),
    ("include_stop_str_in_output", "yes"),
    ("logprobs", -1),
    ("logprobs", 1.0),
    ("logprobs", True),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", "3"),
    ("prompt_logprobs", False),
    ("skip_special_tokens", 0),
    ("presence_penalty", 2.5),
    ("presence_penalty", float("nan")),
    ("presence_penalty", None),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", True),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("logit_bias", {1: 101}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"1": 1.0}),
    ("logit_bias", {1: float("nan")}),
    ("logit_bias", {True: 1.0}),
    ("logit_bias", [(1, 1.0)]),
]


@pytest.mark.parametrize(("field", "bad"), BAD_VALUES)
def test_bad_values_raise_naming_field_and_value(field: str, bad: object) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: bad})
    message = str(info.value)
    assert message.startswith(field + " must be"), message
    assert repr(bad) in message, message


def test_min_tokens_must_not_exceed_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    assert SamplingParams(max_tokens=None, min_tokens=10_000).min_tokens == 10_000


def test_frozen_and_replace_revalidates() -> None:
    p = SamplingParams(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    assert dataclasses.replace(p, top_k=3).top_k == 3
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(p, top_k=-7)


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [(0.0, SamplingType.GREEDY), (9e-6, SamplingType.GREEDY), (1e-5, SamplingType.RANDOM),
     (0.8, SamplingType.RANDOM)],
)
def test_sampling_type(temperature: float, expected: SamplingType) -> None:
    assert SamplingParams(temperature=temperature).sampling_type is expected


def test_greedy_with_n_above_one_is_allowed() -> None:
    p = SamplingParams(n=3, temperature=0.0)
    assert p.n == 3 and p.sampling_type is SamplingType.GREEDY


# --------------------------------------------------------------------------- make_generator


def test_make_generator_with_seed_matches_manual_seed() -> None:
    fallback = _gen(0)
    state = fallback.get_state()
    g = make_generator(1234, fallback)
    assert torch.equal(torch.rand(8, generator=g), torch.rand(8, generator=_gen(1234)))
    assert torch.equal(fallback.get_state(), state)  # a seeded request does not consume the fallback


def test_make_generator_without_seed_is_deterministic_from_fallback() -> None:
    a1 = make_generator(None, _gen(7))
    a2 = make_generator(None, _gen(7))
    assert torch.equal(torch.rand(8, generator=a1), torch.rand(8, generator=a2))
    fallback = _gen(7)
    b1, b2 = make_generator(None, fallback), make_generator(None, fallback)
    assert not torch.equal(torch.rand(8, generator=b1), torch.rand(8, generator=b2))


def test_make_generator_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="seed=.* must be an int"):
        make_generator(1.5, _gen(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fallback must be"):
        make_generator(None, 3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, 0.5, 0.4]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1e-6)]
    gens = [_gen(i) for i in range(3)]
    states = [g.get_state() for g in gens]
    out = sample(logits, params, gens)
    assert out.token_ids.tolist() == [1, 0, 2]
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprobs is None
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))  # untouched


def test_greedy_matches_argmax_on_random_bf16_logits() -> None:
    logits = torch.randn(6, 300, generator=_gen(1)).to(torch.bfloat16)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6, [_gen(0)] * 6)
    assert torch.equal(out.token_ids, torch.argmax(logits.float(), dim=-1))


def test_the_engine_argmax_gives_the_same_tokens_as_torch() -> None:
    """The argmax the engine passes (kv8's kernel where it loads) against torch.argmax, through ``sample``: greedy
    rows with ties and masked tokens, and seeded random rows (the exponential race is an argmax too)."""
    argmax = select_argmax()
    vocab = 49152 + 7   # a real vocabulary size plus a tail that is not a multiple of 16 lanes
    logits = torch.randn(9, vocab, generator=_gen(3)) * 4
    logits[1, 5] = logits[1, 100::37] = 30.0   # ties: the lowest id wins
    logits[2, :vocab - 3] = float("-inf")   # masked tokens: only the last three are candidates
    logits[3, -1] = 1e4                     # the maximum in the tail
    params = [SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=0.8, top_p=0.9, seed=s)
                                                      for s in range(4)]
    ours = sample(logits, params, [make_generator(p.seed, _gen(0)) for p in params], argmax=argmax)
    ref = sample(logits, params, [make_generator(p.seed, _gen(0)) for p in params], argmax=argmax_reference)
    assert torch.equal(ours.token_ids, ref.token_ids)
    assert ours.token_ids[:5].tolist() == torch.argmax(logits[:5], dim=-1).tolist()
    assert ours.token_ids[1] == 5 and ours.token_ids[3] == vocab - 1


# --------------------------------------------------------------------------- reproducibility


def test_seeded_request_is_independent_of_batch_composition_and_position() -> None:
    vocab, steps = 64, 6
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, min_p=0.01, seed=1234)
    target_logits = torch.randn(steps, vocab, generator=_gen(5)) * 2
    fallback = _gen(0)

    gen = make_generator(target.seed, fallback)
    alone = [int(sample(target_logits[s : s + 1], [target], [gen]).token_ids[0]) for s in range(steps)]

    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, seed=9),
        SamplingParams(temperature=0.5, top_p=0.5, logprobs=3),
        SamplingParams(),
    ]
    for position in range(len(others) + 1):
        gen = make_generator(target.seed, fallback)
        other_gens = [make_generator(p.seed, fallback) for p in others]
        batch_params = others[:position] + [target] + others[position:]
        batch_gens = other_gens[:position] + [gen] + other_gens[position:]
        tokens = []
        for s in range(steps):
            noise_logits = torch.randn(len(others), vocab, generator=_gen(100 + s + position))
            logits = torch.cat([noise_logits[:position], target_logits[s : s + 1], noise_logits[position:]])
            tokens.append(int(sample(logits, batch_params, batch_gens).token_ids[position]))
        assert tokens == alone, f"position {position}"


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, 1000)  # uniform: 20 draws agreeing by chance has probability 1e-60
    runs = []
    for seed in (1, 2):
        gen = make_generator(seed, _gen(0))
        runs.append([int(sample(logits, [SamplingParams(seed=seed)], [gen]).token_ids[0]) for _ in range(20)])
    assert runs[0] != runs[1]


# --------------------------------------------------------------------------- filters


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = torch.randn(32, 500, generator=_gen(3)) * 3
    expected = torch.argmax(logits, dim=-1)
    gens = [_gen(i) for i in range(32)]
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        assert torch.equal(sample(logits, [params] * 32, gens).token_ids, expected)


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0, 2.8])
    seen = set(_draw(logits, SamplingParams(temperature=2.0, top_k=3), 600).tolist())
    assert seen == {1, 3, 5}


def test_top_p_keeps_smallest_set_reaching_the_mass() -> None:
    logits = torch.tensor([0.50, 0.30, 0.15, 0.05]).log()
    seen = set(_draw(logits, SamplingParams(top_p=0.75), 600).tolist())
    assert seen == {0, 1}  # 0.5 < 0.75 <= 0.8


def test_temperature_is_applied_before_top_p() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])  # T=1: p = .64 .24 .09 .03, top_p .7 keeps {0, 1}
    assert set(_draw(logits, SamplingParams(top_p=0.7), 600).tolist()) == {0, 1}
    # T=100: nearly uniform, so the first three tokens are needed to reach 0.7.
    assert set(_draw(logits, SamplingParams(temperature=100.0, top_p=0.7), 600).tolist()) == {0, 1, 2}


def test_min_p_never_samples_filtered_tokens() -> None:
    probs = torch.tensor([0.05, 0.40, 0.03, 0.25, 0.12, 0.15])
    logits = probs.log()
    # min_p 0.35: threshold 0.14 keeps tokens 1 (0.40), 3 (0.25), 5 (0.15).
    samples = _draw(logits, SamplingParams(min_p=0.35), 2000, seed=4)
    assert set(samples.tolist()) == {1, 3, 5}


def test_min_p_is_applied_after_temperature() -> None:
    logits = torch.tensor([0.40, 0.25, 0.15, 0.20]).log()
    # T=0.5 squares the ratios: 0.25/0.4 -> 0.39, 0.2/0.4 -> 0.25, 0.15/0.4 -> 0.14; min_p 0.3 keeps {0, 1}.
    assert set(_draw(logits, SamplingParams(temperature=0.5, min_p=0.3), 1000).tolist()) == {0, 1}


def test_masked_logits_are_never_sampled() -> None:
    logits = torch.tensor([0.0, float("-inf"), 0.0, float("-inf")])
    assert set(_draw(logits, SamplingParams(temperature=5.0), 500).tolist()) == {0, 2}


def test_empirical_distribution_matches_softmax_over_temperature() -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 0.6])
    temperature = 0.7
    n = 8000
    samples = _draw(logits, SamplingParams(temperature=temperature), n, seed=11)
    observed = torch.bincount(samples, minlength=4).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (observed.tolist(), expected.tolist(), chi2)  # df=3, p=0.001


# --------------------------------------------------------------------------- logprobs


def test_logprobs_use_raw_logits_and_top_k_is_the_batch_maximum() -> None:
    logits = torch.randn(4, 50, generator=_gen(8)) * 2
    params = [
        SamplingParams(temperature=0.3, logprobs=2),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.7, top_p=0.8),
        SamplingParams(temperature=1.0, logprobs=0),
    ]
    out = sample(logits, params, [_gen(i) for i in range(4)])
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert out.top_logprobs is not None
    values, ids = out.top_logprobs
    assert values.shape == ids.shape == (4, 5)
    assert ids.dtype == torch.int64
    assert torch.all(values[:, :-1] >= values[:, 1:])  # sorted descending
    assert torch.allclose(values, raw.gather(1, ids))
    assert torch.allclose(values, torch.topk(raw, 5, dim=-1).values)


def test_logprobs_zero_gives_empty_top_logprobs() -> None:
    out = sample(torch.randn(2, 10, generator=_gen(0)), [SamplingParams(logprobs=0)] * 2, [_gen(0), _gen(1)])
    assert out.logprobs is not None and out.logprobs.shape == (2,)
    assert out.top_logprobs is not None and out.top_logprobs[0].shape == (2, 0)


def test_compute_logprobs_for_prompt_positions() -> None:
    logits = torch.randn(7, 30, generator=_gen(2)).to(torch.float16)
    ids = torch.tensor([0, 5, 29, 3, 3, 17, 8])
    token_lp, top_values, top_ids = compute_logprobs(logits, ids, 4)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert torch.allclose(token_lp, raw[torch.arange(7), ids])
    assert top_values.shape == top_ids.shape == (7, 4)
    assert torch.equal(top_ids, torch.topk(raw, 4, dim=-1).indices)
    assert math.isclose(float(torch.logsumexp(raw[0], dim=0)), 0.0, abs_tol=1e-5)


def test_compute_logprobs_rejects_bad_arguments() -> None:
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="k=.* must be an int"):
        compute_logprobs(logits, torch.tensor([0, 1]), 6)
    with pytest.raises(ValueError, match="token_ids must"):
        compute_logprobs(logits, torch.tensor([0, 5]), 1)
    with pytest.raises(ValueError, match="token_ids must"):
        compute_logprobs(logits, torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="logits must"):
        compute_logprobs(torch.zeros(5), torch.tensor([0]), 1)


# --------------------------------------------------------------------------- input checks


def test_sample_rejects_bad_inputs() -> None:
    """Shape and non-finite logits only: per-row params are validated once, where a request enters the engine
    (SamplingParams at construction, logprobs against the vocabulary in the input processor)."""
    p, g = SamplingParams(), _gen(0)
    with pytest.raises(ValueError, match="logits must"):
        sample(torch.zeros(4), [p], [g])
    with pytest.raises(ValueError, match="logits must"):
        sample(torch.zeros(1, 4, dtype=torch.int64), [p], [g])
    with pytest.raises(ValueError, match="params must have one entry per logits row"):
        sample(torch.zeros(2, 4), [p], [g, g])
    with pytest.raises(ValueError, match="generators must have one entry per logits row"):
        sample(torch.zeros(2, 4), [p, p], [g])
    with pytest.raises(ValueError, match=r"logits rows \[1\]"):
        sample(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]), [p, p], [g, g])
    with pytest.raises(ValueError, match=r"logits rows \[0\]"):
        sample(torch.full((1, 3), float("-inf")), [p], [g])


def test_empty_batch() -> None:
    out = sample(torch.zeros(0, 8), [], [])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids.shape == (0,) and out.logprobs is None and out.top_logprobs is None


@pytest.mark.parametrize("seed", range(6))
def test_partial_selection_filters_keep_what_the_full_sort_keeps(seed: int) -> None:
    """The filters on the top candidates (topk) keep exactly the tokens the full-vocabulary stable sort keeps,
    for top-k, top-p, min-p and their mixes, rows without filters, masked (-inf) logits and ties."""
    from kv8.engine.sampler import _apply_filters, apply_filters_reference

    gen = torch.Generator().manual_seed(seed)
    vocab = 5000
    scale = [0.5, 2.0, 6.0][seed % 3]   # flat to peaked distributions
    logits = torch.randn(9, vocab, generator=gen) * scale
    logits[1, :300] = float("-inf")
    logits[2, 10:20] = logits[2, 10]     # ties
    params = [
        SamplingParams(temperature=1.0, top_k=50),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.5, top_k=200),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.02),
        SamplingParams(temperature=1.0),                       # no filter: the row comes back unchanged
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_k=3000),           # K past half the vocabulary: the reference path
        SamplingParams(temperature=1.0, top_p=0.999),          # the nucleus may not close within the candidates
    ]
    scaled = logits - logits.amax(dim=-1, keepdim=True)
    for rows in ([0, 1, 2, 3, 4, 5, 6], [0, 3, 5], list(range(9)), [5]):
        got = _apply_filters(scaled[rows], [params[i] for i in rows])
        want = apply_filters_reference(scaled[rows], [params[i] for i in rows])
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), rows
        assert torch.equal(got[torch.isfinite(got)], want[torch.isfinite(want)]), rows


def test_partial_selection_serves_top_k_and_peaked_top_p_without_the_full_sort(monkeypatch) -> None:
    import kv8.engine.sampler as sampler_mod

    want = sampler_mod.apply_filters_reference
    gen = torch.Generator().manual_seed(0)
    scaled = torch.randn(3, 50000, generator=gen) * 4.0
    scaled -= scaled.amax(dim=-1, keepdim=True)
    params = [SamplingParams(temperature=1.0, top_k=40), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.0, min_p=0.1)]
    expected = want(scaled, params)

    def no_full_sort(*args, **kwargs):
        raise AssertionError("the full-vocabulary sort ran")

    monkeypatch.setattr(sampler_mod, "apply_filters_reference", no_full_sort)
    got = sampler_mod._apply_filters(scaled, params)
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))


# --------------------------------------------------------------------------- penalties and logit bias


def _penalties_reference(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, token by token, as vLLM defines it: bias, then repetition (prompt + output), frequency and
    presence (output only)."""
    out = row.clone().tolist()
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty * (t in output)
    return torch.tensor(out, dtype=torch.float32)


def test_penalties_and_logit_bias_match_the_reference_row_by_row() -> None:
    vocab = 40
    g = _gen(3)
    logits = torch.randn(5, vocab, generator=g) * 3
    logits[2, 7] = float("-inf")   # a masked token stays masked
    rows = [
        (SamplingParams(presence_penalty=0.7), [1, 2, 3], [4, 4, 5]),
        (SamplingParams(frequency_penalty=-0.5, repetition_penalty=1.4), [6, 7, 7], [7, 8, 8, 8]),
        (SamplingParams(repetition_penalty=0.6, logit_bias={7: 5.0, 9: -100}), [7, 9, 10], [11]),
        (SamplingParams(), [], []),                             # nothing on: untouched
        (SamplingParams(logit_bias={0: 2.5}, presence_penalty=-1.0, frequency_penalty=1.0), [0], [0, 0, 39]),
    ]
    params = [r[0] for r in rows]
    hist = [TokenHistory(r[1], r[2]) if r[0].uses_penalties else None for r in rows]
    got = apply_penalties(logits, params, hist)
    for i, (p, prompt, output) in enumerate(rows):
        torch.testing.assert_close(got[i], _penalties_reference(logits[i], p, prompt, output), rtol=0, atol=1e-6)
    assert torch.equal(got[3], logits[3]) and got[2, 7] == float("-inf")
    # nothing on anywhere: the very same tensor comes back
    assert apply_penalties(logits, [SamplingParams()] * 5, None) is logits


def test_penalties_change_greedy_and_leave_logprobs_raw() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    hist = [TokenHistory([0], [])]
    assert int(sample(logits, [SamplingParams(temperature=0)], [_gen(0)]).token_ids[0]) == 0
    out = sample(logits, [SamplingParams(temperature=0, repetition_penalty=1.2, logprobs=1)], [_gen(0)], hist)
    assert int(out.token_ids[0]) == 1                      # 3.0 / 1.2 = 2.5 < 2.9
    assert out.logprobs is not None
    assert float(out.logprobs[0]) == pytest.approx(float(torch.log_softmax(logits, -1)[0, 1]))
    biased = sample(logits, [SamplingParams(temperature=0, logit_bias={3: 10})], [_gen(0)])
    assert int(biased.token_ids[0]) == 3
    # a repetition penalty near 0 cannot overflow a logit to inf (which would poison the random path)
    tiny = SamplingParams(temperature=1.0, repetition_penalty=1e-38, seed=0)
    assert int(sample(logits * 1e3, [tiny], [_gen(0)], hist).token_ids[0]) == 0


def test_seeded_sampling_is_unchanged_when_penalties_are_off_and_rows_are_independent() -> None:
    vocab = 64
    logits = torch.randn(3, vocab, generator=_gen(11)) * 2
    plain = SamplingParams(temperature=0.8, top_k=20, seed=5)
    before = sample(logits, [plain] * 3, [_gen(i) for i in range(3)]).token_ids
    # same rows, now alongside penalised rows: the unpenalised rows draw the same tokens
    pen = SamplingParams(temperature=0.8, top_k=20, seed=5, presence_penalty=2.0, logit_bias={1: 3})
    hist: list[TokenHistory | None] = [None, TokenHistory([1, 2], [3, 3]), None]
    mixed = sample(logits, [plain, pen, plain], [_gen(i) for i in range(3)], hist).token_ids
    assert mixed[0] == before[0] and mixed[2] == before[2]
    with pytest.raises(ValueError, match="histories"):
        sample(logits, [plain, pen, plain], [_gen(i) for i in range(3)], [None, None, None])


def test_presence_penalty_avoids_repeats_empirically() -> None:
    logits = torch.zeros(1, 8)
    p = SamplingParams(temperature=1.0, presence_penalty=2.0, frequency_penalty=2.0)
    hist = [TokenHistory([], [0, 1, 2, 3, 0, 1, 2, 3])]
    draws = [int(sample(logits, [p], [_gen(s)], hist).token_ids[0]) for s in range(400)]
    # weight of a repeated token: exp(-2 - 4) vs 1 for the four unseen ones: < 1% of draws
    assert sum(d < 4 for d in draws) <= 8
