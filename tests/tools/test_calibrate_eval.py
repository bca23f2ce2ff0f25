"""``kv8 calibrate`` / ``kv8 eval``: scales from observed K/V, output formats, --save-model, perplexity.

Oracles are independent of kv8's engine: the post-RoPE K/V and the log-probabilities come from transformers
(its DynamicCache holds exactly what a KV cache stores), run in float32 on the same token windows.
"""

from __future__ import annotations

import bz2
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from kv8.engine.args import EngineArgs
from kv8.engine.engine import LLMEngine
from kv8.entrypoints.cli import main
from kv8.quant.formats import E4M3, E4M3FNUZ, E5M2
from kv8.quant.scale_files import load_scales_file
from kv8.quant.scales import KVScales, ModelScaleInfo, ScaleGranularity
from kv8.sampling_params import SamplingParams
from kv8.tools.calibrate import calibrate
from kv8.tools.data import read_documents, token_windows
from kv8.tools.evaluate import ConfigResult, EvalReport, KVConfig, evaluate
from kv8.tools.export import save_model_with_scales, write_scales
from kv8.tools.kv_stats import BINS_PER_OCTAVE, ScaleRecipe
from tests.helpers.calibration import hf_kv, hf_scored_nll, hf_windows

SEQ, SAMPLES = 32, 3
RAW = dict(key_bound="observed", power_of_two=False, v_headroom=1.0)  # scales = statistic of stored values / max
def _reduce_amax(x: torch.Tensor, granularity: ScaleGranularity) -> torch.Tensor:
    a = x.abs().amax(dim=0)                                    # [H, D]
    if granularity is ScaleGranularity.TENSOR:
        return a.amax().reshape(1, 1)
    if granularity is ScaleGranularity.HEAD:
        return a.amax(dim=1, keepdim=True)
    return a


@pytest.mark.parametrize("granularity", list(ScaleGranularity))
def test_amax_scales_are_observed_maxima_over_format_max(tiny_models: dict[str, str], text_file: str,
                                                          granularity: ScaleGranularity) -> None:
    model = tiny_models["llama_gqa"]
    result = calibrate(model, [text_file], ScaleRecipe(granularity, "amax", E4M3, **RAW), num_samples=SAMPLES,
                       seq_len=SEQ, dtype="float32", batch=2, show_progress=False)
    kv = hf_kv(model, hf_windows(model, text_file, SEQ, SAMPLES))
    assert result.num_tokens == SAMPLES * SEQ
    assert result.scales.granularity is granularity and result.scales.made_for == "fp8_e4m3"
    for i, (k, v) in enumerate(kv):
        torch.testing.assert_close(result.scales.k[i], _reduce_amax(k, granularity) / 448.0, rtol=1e-5, atol=0)
        torch.testing.assert_close(result.scales.v[i], _reduce_amax(v, granularity) / 448.0, rtol=1e-5, atol=0)


def test_headroom_and_format_scale_the_statistic(tiny_models: dict[str, str], text_file: str) -> None:
    model = tiny_models["llama"]
    base = calibrate(model, [text_file], ScaleRecipe(ScaleGranularity.TENSOR, "amax", E4M3), num_samples=2,
                     seq_len=SEQ, dtype="float32", show_progress=False).scales
    other = calibrate(model, [text_file], ScaleRecipe(ScaleGranularity.TENSOR, "amax", E5M2, headroom=2.0),
                      num_samples=2, seq_len=SEQ, dtype="float32", show_progress=False).scales
    torch.testing.assert_close(other.k, base.k * 448.0 * 2.0 / 57344.0, rtol=1e-6, atol=0)
    assert other.made_for == "fp8_e5m2"


def _fp8_sq_error(x: torch.Tensor, scale: torch.Tensor) -> float:
    return float(((E4M3.decode(E4M3.encode(x / scale)) * scale - x) ** 2).sum())


def test_percentile_and_mse_statistics(tiny_models: dict[str, str], text_file: str) -> None:
    model = tiny_models["llama"]
    kv = hf_kv(model, hf_windows(model, text_file, SEQ, SAMPLES))
    q = 90.0
    recipe = ScaleRecipe(ScaleGranularity.HEAD, "percentile", E4M3, percentile=q, **RAW)
    pct = calibrate(model, [text_file], recipe, num_samples=SAMPLES, seq_len=SEQ, dtype="float32",
                    show_progress=False).scales
    for i, (k, _) in enumerate(kv):
        for h in range(k.shape[1]):
            values = k[:, h].abs().flatten().sort().values
            true = float(values[math.ceil(q / 100 * values.numel()) - 1])
            got = float(pct.k[i, h, 0]) * 448.0
            assert true * (1 - 1e-6) <= got <= true * 2 ** (1 / BINS_PER_OCTAVE) * (1 + 1e-6)
    mse = calibrate(model, [text_file], ScaleRecipe(ScaleGranularity.TENSOR, "mse", E4M3, **RAW),
                    num_samples=SAMPLES, seq_len=SEQ, dtype="float32", show_progress=False).scales
    for i, (k, v) in enumerate(kv):
        for x, got in ((k, mse.k[i]), (v, mse.v[i])):
            amax_scale = x.abs().max() / 448.0
            assert float(got) <= float(amax_scale) * (1 + 1e-6)
            assert _fp8_sq_error(x, got) <= _fp8_sq_error(x, amax_scale) * 1.02


def _pow2_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x, by float64 search (independent of kv8's rounding helper)."""
    out = torch.ones_like(x, dtype=torch.float64)
    for _ in range(80):
        out = torch.where(out < x.double(), out * 2, out)
        out = torch.where(out / 2 >= x.double(), out / 2, out)
    return out.float()


def _pair_norm_envelope(k: torch.Tensor, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """Largest |k_i| a key channel can reach at any RoPE position, written out from the definition."""
    half = k.shape[-1] // 2
    base = k if rotation is None else k @ rotation.T
    r = (base[..., :half] ** 2 + base[..., half:] ** 2).sqrt()
    if rotation is None:
        return torch.cat((r, r), dim=-1)
    # normalized Sylvester-Hadamard: every entry is +-1/sqrt(D), so each pair reaches sqrt(2/D) * r
    return (r.sum(-1, keepdim=True) * math.sqrt(2.0 / k.shape[-1])).expand_as(k)


@pytest.mark.parametrize("granularity", list(ScaleGranularity))
def test_default_scales_are_powers_of_two_over_the_position_invariant_key_envelope(
        tiny_models: dict[str, str], text_file: str, granularity: ScaleGranularity) -> None:
    model = tiny_models["llama_gqa"]
    recipe = ScaleRecipe(granularity, "amax", E4M3)
    assert recipe.key_bound == "position" and recipe.power_of_two
    result = calibrate(model, [text_file], recipe, num_samples=SAMPLES, seq_len=SEQ, dtype="float32",
                       show_progress=False)
    kv = hf_kv(model, hf_windows(model, text_file, SEQ, SAMPLES))
    assert "position key bound" in result.scales.source and "power-of-two" in result.scales.source
    for i, (k, v) in enumerate(kv):
        want_k = _pow2_up(_reduce_amax(_pair_norm_envelope(k), granularity) / 448.0)
        torch.testing.assert_close(result.scales.k[i], want_k, rtol=0, atol=0)
        want_v = _pow2_up(_reduce_amax(v, granularity) * 2.0 / 448.0)  # default v_headroom 2
        torch.testing.assert_close(result.scales.v[i], want_v, rtol=0, atol=0)
        assert bool((result.scales.k[i] >= _reduce_amax(k, granularity) / 448.0).all())


def test_rotated_key_envelope(tiny_models: dict[str, str], text_file: str) -> None:
    from kv8.quant.rotation import hadamard

    model = tiny_models["llama_gqa"]
    res = calibrate(model, [text_file], ScaleRecipe(ScaleGranularity.CHANNEL, "amax", E4M3), num_samples=2,
                    seq_len=16, dtype="float32", rotation="hadamard", show_progress=False).scales
    rot = hadamard(16)
    for i, (k, _) in enumerate(hf_kv(model, hf_windows(model, text_file, 16, 2))):
        want = _pow2_up(_pair_norm_envelope(k @ rot, rot).abs().amax(dim=0) / 448.0)
        torch.testing.assert_close(res.k[i], want, rtol=0, atol=0)


def _hf_keys_at(model_dir: str, window: list[int], offset: int) -> list[torch.Tensor]:
    """transformers' cached (post-RoPE) keys ``[T, H, D]`` per layer for ``window`` placed at ``offset``."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = DynamicCache()
    positions = torch.arange(offset, offset + len(window)).unsqueeze(0)
    with torch.no_grad():
        model(torch.tensor([window]), position_ids=positions, past_key_values=cache, use_cache=True)
    return [layer.keys[0].transpose(0, 1) for layer in cache.layers]


def test_position_bound_key_scales_hold_at_positions_calibration_never_saw(tiny_models: dict[str, str],
                                                                          text_file: str) -> None:
    """Shifting every position of a text changes no pre-RoPE key (RoPE attention only sees relative
    positions), so the same keys show up rotated by other angles: the envelope covers them all, while scales
    from the observed keys are exceeded."""
    model = tiny_models["llama_gqa"]
    kw = dict(num_samples=2, seq_len=SEQ, dtype="float32", show_progress=False)
    bound = calibrate(model, [text_file], ScaleRecipe(ScaleGranularity.CHANNEL, "amax", E4M3, **(RAW | {
        "key_bound": "position"})), **kw).scales
    seen = calibrate(model, [text_file], ScaleRecipe(ScaleGranularity.CHANNEL, "amax", E4M3, **RAW), **kw).scales
    window = hf_windows(model, text_file, SEQ, 1)[0]
    worst_bound, worst_seen = 0.0, 0.0
    for offset in (0, 7, 100, 333, 2000, 12345):
        for i, k in enumerate(_hf_keys_at(model, window, offset)):
            a = k.abs().amax(dim=0)
            worst_bound = max(worst_bound, float((a / (bound.k[i] * 448.0)).max()))
            worst_seen = max(worst_seen, float((a / (seen.k[i] * 448.0)).max()))
    assert worst_bound <= 1.0 + 1e-5
    assert worst_seen > 1.05  # observed-key scales would clip these keys


def test_held_out_clip_check_counts_what_would_clip(tiny_models: dict[str, str], text_file: str) -> None:
    """The check runs the windows after the calibration windows; its clip fractions and worst ratios equal
    those computed from transformers' K/V of the same windows and the calibrated scales."""
    model = tiny_models["llama_gqa"]
    res = calibrate(model, [text_file], ScaleRecipe(ScaleGranularity.CHANNEL, "amax", E4M3, **RAW), num_samples=2,
                    seq_len=SEQ, dtype="float32", check_samples=2, show_progress=False)
    check = res.check
    assert check is not None and check.num_tokens == 2 * SEQ
    held_out = hf_kv(model, hf_windows(model, text_file, SEQ, 2, skip=2 * SEQ))
    any_clipped = False
    for i, (k, v) in enumerate(held_out):
        for x, scale, frac, worst in ((k, res.scales.k[i], check.k_clipped[i], check.k_worst[i]),
                                      (v, res.scales.v[i], check.v_clipped[i], check.v_worst[i])):
            ratio = x.abs() / (scale * 448.0)
            assert frac == pytest.approx(float((ratio > 1).float().mean()), abs=1e-9)
            assert worst == pytest.approx(float(ratio.max()), rel=1e-5)
            any_clipped |= frac > 0
    assert any_clipped and not check.clean and "would clip" in check.summary()
    assert "--headroom" in check.summary()

@pytest.mark.parametrize("fmt", [E4M3, E4M3FNUZ, E5M2], ids=lambda f: f.name)
def test_power_of_two_scales_never_round_worse_than_scale_one(fmt) -> None:
    """For s = 2^-k <= 1 every value within s * max rounds at least as close as with scale 1.0; a scale that
    is not a power of two does not have that property."""
    gen = torch.Generator().manual_seed(0)
    mags = torch.exp2(torch.empty(200_000).uniform_(-24, math.log2(fmt.max_finite), generator=gen))
    x = mags * torch.where(torch.rand(mags.shape, generator=gen) < 0.5, -1.0, 1.0)

    def err(values: torch.Tensor, scale: float) -> torch.Tensor:
        return (fmt.decode(fmt.encode(values / scale)) * scale - values).abs()

    for k in range(0, 9):
        s = 2.0 ** -k
        inside = x[x.abs() <= s * fmt.max_finite]
        assert bool((err(inside, s) <= err(inside, 1.0)).all()), f"scale 2^-{k}"
    odd = 0.75 / 16
    inside = x[x.abs() <= odd * fmt.max_finite]
    assert bool((err(inside, odd) > err(inside, 1.0)).any())


def test_power_of_two_mse_picks_a_power_of_two_at_or_below_the_amax_one(tiny_models: dict[str, str],
                                                                         text_file: str) -> None:
    model = tiny_models["llama"]
    kw = dict(num_samples=SAMPLES, seq_len=SEQ, dtype="float32", show_progress=False)
    mse = calibrate(model, [text_file], ScaleRecipe(ScaleGranularity.TENSOR, "mse", E4M3), **kw).scales
    amax = calibrate(model, [text_file], ScaleRecipe(ScaleGranularity.TENSOR, "amax", E4M3), **kw).scales
    for got, top in ((mse.k, amax.k), (mse.v, amax.v)):
        assert torch.equal(torch.exp2(torch.round(torch.log2(got))), got)
        assert bool((got <= top).all()) and bool((got >= top / 8).all())


class _StoredBytes:
    """Test backend wrapper: records what the cache holds for every new token after the store."""

    def __init__(self, inner):  # type: ignore[no-untyped-def]
        self.inner, self.name, self.stored = inner, "stored-bytes", []

    def forward(self, query, key, value, cache, layer, meta, scale):  # type: ignore[no-untyped-def]
        out = self.inner.forward(query, key, value, cache, layer, meta, scale)
        bs = cache.shape.block_size
        k_cache, v_cache = cache.layer(layer)
        blocks, offsets = meta.slot_mapping // bs, meta.slot_mapping % bs
        self.stored.append((k_cache[blocks, :, offsets].clone(), v_cache[blocks, :, offsets].clone()))
        return out


def _cache_contents(model: str, prompt: list[int], **kwargs: object) -> tuple[KVScales, list]:
    engine = LLMEngine(EngineArgs(model=model, kv_cache_dtype="fp8_e4m3", num_kv_blocks=8, max_model_len=64,
                                  enable_prefix_caching=False, dtype="float32", **kwargs))  # type: ignore[arg-type]
    probe = _StoredBytes(engine.runner.backend)
    engine.runner.backend = probe
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cache.scales is not None
    return engine.cache.scales, probe.stored


def _same_contents(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_every_output_format_loads_back_with_the_same_cache_contents(tiny_models: dict[str, str], text_file: str,
                                                                       tmp_path: Path) -> None:
    model = tiny_models["qwen2"]
    res = calibrate(model, [text_file], ScaleRecipe(ScaleGranularity.TENSOR, "amax", E4M3, **RAW), num_samples=2,
                    seq_len=SEQ, dtype="float32", show_progress=False)
    s, info = res.scales, res.info
    assert not torch.equal(s.k, s.v)
    prompt = hf_windows(model, text_file, 20, 1, skip=500)[0]

    write_scales(str(tmp_path / "kv8.json"), s, info, "kv8")
    write_scales(str(tmp_path / "vllm.json"), s, info, "vllm")
    save_model_with_scales(model, str(tmp_path / "model"), s)
    both = torch.maximum(s.k, s.v)
    write_scales(str(tmp_path / "kv8_max.json"), KVScales(both, both, s.granularity, "test", s.made_for), info, "kv8")

    assert torch.equal(load_scales_file(tmp_path / "kv8.json", info).k, s.k)
    assert torch.equal(load_scales_file(tmp_path / "vllm.json", info).v, both)
    from_json, bytes_json = _cache_contents(model, prompt, quantization_param_path=str(tmp_path / "kv8.json"))
    from_ckpt, bytes_ckpt = _cache_contents(str(tmp_path / "model"), prompt)
    assert torch.equal(from_json.k, s.k) and torch.equal(from_json.v, s.v)
    assert torch.equal(from_ckpt.k, s.k) and torch.equal(from_ckpt.v, s.v) and "checkpoint" in from_ckpt.source
    assert _same_contents(bytes_json, bytes_ckpt)
    from_vllm, bytes_vllm = _cache_contents(model, prompt, quantization_param_path=str(tmp_path / "vllm.json"))
    _, bytes_max = _cache_contents(model, prompt, quantization_param_path=str(tmp_path / "kv8_max.json"))
    assert torch.equal(from_vllm.k, both) and _same_contents(bytes_vllm, bytes_max)
    assert not _same_contents(bytes_vllm, bytes_json)


@pytest.mark.parametrize("granularity", [ScaleGranularity.HEAD, ScaleGranularity.CHANNEL])
def test_kv8_json_round_trips_finer_granularity(tiny_models: dict[str, str], text_file: str, tmp_path: Path,
                                                granularity: ScaleGranularity) -> None:
    model = tiny_models["llama_gqa"]
    res = calibrate(model, [text_file], ScaleRecipe(granularity, "amax", E4M3), num_samples=1, seq_len=SEQ,
                    dtype="float32", show_progress=False)
    path = tmp_path / "s.json"
    write_scales(str(path), res.scales, res.info, "kv8")
    doc = json.loads(path.read_text())
    assert doc["format"] == "kv8-kv-scales" and doc["granularity"] == granularity.value
    loaded, _ = _cache_contents(model, [5, 6, 7, 8], quantization_param_path=str(path))
    assert torch.equal(loaded.k, res.scales.k) and torch.equal(loaded.v, res.scales.v)
    if granularity is ScaleGranularity.HEAD:
        save_model_with_scales(model, str(tmp_path / "m"), res.scales)
        from_ckpt, _ = _cache_contents(str(tmp_path / "m"), [5, 6, 7, 8])
        assert torch.equal(from_ckpt.k, res.scales.k) and from_ckpt.granularity is ScaleGranularity.HEAD
        config = json.loads((tmp_path / "m" / "config.json").read_text())
        assert config["kv_cache_torch_dtype"] == "float8_e4m3fn"
        from transformers import AutoModelForCausalLM  # the saved directory is still a loadable HF model
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"))
    else:
        with pytest.raises(ValueError, match="channel-granularity"):
            save_model_with_scales(model, str(tmp_path / "m"), res.scales)
        with pytest.raises(ValueError, match="one scale per layer"):
            write_scales(str(tmp_path / "v.json"), res.scales, res.info, "vllm")


def test_eval_perplexity_equals_transformers_and_metrics_are_consistent(tiny_models: dict[str, str],
                                                                         text_file: str, tmp_path: Path) -> None:

    model = tiny_models["llama"]
    window, n = 24, 3
    report = evaluate(model, [text_file], [KVConfig("float32"), KVConfig("fp8_e5m2")], window=window,
                      num_windows=n, skip_tokens=7, gen_prompts=2, gen_prompt_len=6, gen_tokens=5, dtype="float32",
                      max_num_batched_tokens=10, show_progress=False)
    nll = hf_scored_nll(model, text_file, window, n, skip=7)
    assert report.scored_tokens == len(nll) == n * (window - window // 2)
    assert report.reference.perplexity == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    same, fp8 = report.results
    assert same.mean_kld == pytest.approx(0.0, abs=1e-12) and same.top1_agreement == 1.0
    assert same.greedy_identical == 1.0 and same.greedy_mean_match == 5.0 and same.delta_ppl == pytest.approx(0.0)
    assert fp8.bytes_per_token * 4 == same.bytes_per_token
    assert fp8.mean_kld > 0 and 0 <= fp8.top1_agreement <= 1 and min(fp8.layer_k_rel_err) > 0
    assert max(same.layer_k_rel_err) == 0.0 and fp8.layer_k_scale_max == [1.0, 1.0]


def test_cli_calibrate_and_eval(tiny_models: dict[str, str], text_file: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_models["llama"]
    out = tmp_path / "kv_cache_scales.json"
    assert main(["calibrate", model, "--data", text_file, "--num-samples", "2", "--seq-len", str(SEQ),
                 "--output", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["kv_cache"]["dtype"] == "float8_e4m3fn"   # vLLM schema by default
    report, plot = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["eval", model, "--data", text_file, "--config",
                 f"--kv-cache-dtype fp8_e4m3 --quantization-param-path {out}", "--config", "fp8_e5m2",
                 "--window", "16", "--num-windows", "1", "--gen-prompts", "1", "--gen-prompt-len", "4",
                 "--gen-tokens", "3", "--json", str(report), "--plot", str(plot), "--no-progress"]) == 0
    assert "fp8_e4m3:" in capsys.readouterr().out
    labels = [r["label"] for r in json.loads(report.read_text())["results"]]
    assert labels == [f"fp8_e4m3:{out}", "fp8_e5m2"]
    assert f"fp8_e4m3:{out}" in EvalReport.from_dict(json.loads(report.read_text())).table()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_calibrate_key_centering(tiny_models: dict[str, str], text_file: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """--key-centering writes the mean post-RoPE key (transformers' keys as the oracle) as k_offset in a kv8 file;
    the scales are those of the centered keys; an int4 engine loads the file and eval measures it."""
    from kv8.quant.scale_files import load_key_offsets

    model = tiny_models["llama_gqa"]
    out = tmp_path / "centered.json"
    assert main(["calibrate", model, "--data", text_file, "--num-samples", str(SAMPLES), "--seq-len", str(SEQ),
                 "--key-bound", "observed", "--scale-rounding", "none", "--v-headroom", "1", "--dtype", "float32",
                 "--key-centering", "--output", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "key offsets: |c| up to" in printed and "centered keys)" in printed
    info = ModelScaleInfo("llama", 2, 2, 16)
    offsets = load_key_offsets(out, info)
    scales = load_scales_file(out, info)
    assert offsets is not None
    for i, (k, _) in enumerate(hf_kv(model, hf_windows(model, text_file, SEQ, SAMPLES))):
        torch.testing.assert_close(offsets.k[i], k.mean(dim=0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(scales.k[i], (k - offsets.k[i]).abs().amax().reshape(1, 1) / 448.0, rtol=1e-5,
                                   atol=0)
    report = tmp_path / "r.json"
    assert main(["eval", model, "--data", text_file, "--config", "int4", "--config",
                 f"--kv-cache-dtype int4 --quantization-param-path {out}", "--window", "16", "--num-windows", "1",
                 "--gen-prompts", "0", "--json", str(report), "--no-progress"]) == 0
    assert [r["label"] for r in json.loads(report.read_text())["results"]] == ["int4", f"int4:{out}"]
    # what cannot carry offsets is refused before the model runs
    for extra in (["--output-format", "vllm"], ["--save-model", str(tmp_path / "m")]):
        assert main(["calibrate", model, "--data", text_file, "--key-centering", "--output",
                     str(tmp_path / "x.json"), *extra]) == 2
        assert "key offsets (--key-centering) are written only in kv8's scales JSON" in capsys.readouterr().err


def test_cli_calibrate_key_scaling(tiny_models: dict[str, str], text_file: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--key-centering --key-scaling writes factors (positive, geometric mean 1 per head) beside the offsets; an
    int4 engine loads the file and eval measures it; --key-scaling alone is refused."""
    from kv8.quant.scale_files import load_key_scaling

    model = tiny_models["llama_gqa"]
    out = tmp_path / "scaled.json"
    assert main(["calibrate", model, "--data", text_file, "--num-samples", str(SAMPLES), "--seq-len", str(SEQ),
                 "--dtype", "float32", "--key-centering", "--key-scaling", "--output", str(out),
                 "--no-progress"]) == 0
    assert "key scaling: factors" in capsys.readouterr().out
    scaling = load_key_scaling(out, ModelScaleInfo("llama", 2, 2, 16))
    assert scaling is not None and bool((scaling.s > 0).all())
    torch.testing.assert_close(scaling.s.log().mean(-1), torch.zeros(2, 2), atol=1e-5, rtol=0)
    assert not torch.allclose(scaling.s, torch.ones_like(scaling.s))
    report = tmp_path / "r.json"
    assert main(["eval", model, "--data", text_file, "--config", f"--kv-cache-dtype int4 --quantization-param-path "
                 f"{out}", "--window", "16", "--num-windows", "1", "--gen-prompts", "0", "--json", str(report),
                 "--no-progress"]) == 0
    assert [r["label"] for r in json.loads(report.read_text())["results"]] == [f"int4:{out}"]
    assert main(["calibrate", model, "--data", text_file, "--key-scaling", "--output", str(tmp_path / "x.json")]) == 2
    assert "--key-scaling: the factors are written only beside key offsets" in capsys.readouterr().err


def test_data_formats(tmp_path: Path) -> None:
    wiki = ("<mediawiki xmlns=\"http://www.mediawiki.org/xml/export-0.10/\"><page><title>A</title><ns>0</ns>"
            "<revision><text>'''Alpha''' is a [[Greek alphabet|letter]].{{Infobox|x={{y}}}}&lt;ref&gt;cite"
            "&lt;/ref&gt;\n== History ==\nOld [[File:a.png|thumb|pic]] text.</text></revision></page>"
            "<page><title>B</title><ns>0</ns><redirect title=\"A\"/><revision><text>#REDIRECT [[A]]</text>"
            "</revision></page><page><title>T</title><ns>1</ns><revision><text>talk</text></revision></page>"
            "</mediawiki>")
    (tmp_path / "w.xml.bz2").write_bytes(bz2.compress(wiki.encode()))
    assert read_documents(str(tmp_path / "w.xml.bz2")) == ["Alpha is a letter.\nHistory\nOld  text."]
    (tmp_path / "d.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert read_documents(str(tmp_path / "d.jsonl")) == ["one", "two"]
    assert token_windows(list(range(10)), 3, None, skip=2) == [[2, 3, 4], [5, 6, 7]]


def test_bad_inputs_give_clear_errors(tiny_models: dict[str, str], text_file: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_models["llama"]
    recipe = ScaleRecipe(ScaleGranularity.TENSOR, "amax", E4M3)
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": 1}\n')
    (tmp_path / "bad.bz2").write_bytes(b"not bzip2")
    for path, message in ((tmp_path / "empty.txt", "holds no text"), (tmp_path / "missing.txt", "cannot be read"),
                          (tmp_path / "bad.jsonl", "line 2"), (tmp_path / "bad.bz2", "not valid bzip2")):
        with pytest.raises(ValueError, match=message):
            read_documents(str(path))
    with pytest.raises(ValueError, match=r"skipping 1000000 \(--skip-tokens\) not even one window of --seq-len "
                                         rf"{SEQ} tokens fits; give more text \(--data\) or a smaller --seq-len"):
        calibrate(model, [text_file], recipe, num_samples=1, seq_len=SEQ, skip_tokens=10**6, show_progress=False)
    with pytest.raises(ValueError, match="seq_len=512 is too long for the model: its context is 512"):
        calibrate(model, [text_file], recipe, num_samples=1, seq_len=512, show_progress=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(Path(model, "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"broken/model.safetensors: not a valid safetensors file"):
        calibrate(str(broken), [text_file], recipe, seq_len=SEQ, show_progress=False)
    with pytest.raises(ValueError, match="statistic='max'"):
        ScaleRecipe(ScaleGranularity.TENSOR, "max", E4M3)
    with pytest.raises(ValueError, match="headroom"):
        ScaleRecipe(ScaleGranularity.TENSOR, "amax", E4M3, headroom=0.0)
    with pytest.raises(ValueError, match="v_headroom=-1"):
        ScaleRecipe(ScaleGranularity.TENSOR, "amax", E4M3, v_headroom=-1)
    with pytest.raises(ValueError, match="check_samples=-1 must be an int >= 0"):
        calibrate(model, [text_file], recipe, seq_len=SEQ, check_samples=-1, show_progress=False)
    with pytest.raises(ValueError, match="key_bound='rope'.*position, observed"):
        ScaleRecipe(ScaleGranularity.TENSOR, "amax", E4M3, key_bound="rope")
    with pytest.raises(ValueError, match="power_of_two=1"):
        ScaleRecipe(ScaleGranularity.TENSOR, "amax", E4M3, power_of_two=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_dtype='fp9'"):
        KVConfig("fp9", "x.json")
    assert main(["calibrate", model, "--data", str(tmp_path / "empty.txt"), "--output", "x.json"]) == 2
    assert "holds no text" in capsys.readouterr().err
    assert main(["calibrate", str(tmp_path / "nope"), "--data", text_file, "--output", "x.json"]) == 2
    assert "not accepted" in capsys.readouterr().err
    assert main(["calibrate", model, "--data", text_file, "--granularity", "head", "--output-format", "vllm",
                 "--output", "x.json"]) == 2
    assert "--output-format kv8" in capsys.readouterr().err
    assert not os.path.exists("x.json")
    info = ModelScaleInfo("llama", 2, 4, 16)
    (tmp_path / "wrong.json").write_text(json.dumps({"format": "kv8-kv-scales", "version": 1, "model_type": "llama",
                                                     "num_layers": 3, "num_kv_heads": 4, "head_dim": 16}))
    with pytest.raises(ValueError, match="num_layers is 3"):
        load_scales_file(tmp_path / "wrong.json", info)


def test_save_model_from_a_sharded_checkpoint_replaces_old_scales(tiny_models: dict[str, str], text_file: str,
                                                                   tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).save_pretrained(source, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(tiny_models["llama"]).save_pretrained(source)
    half = torch.full((2, 1, 1), 0.5)
    first = save_model_with_scales(str(source), str(tmp_path / "a"), KVScales(half, half, ScaleGranularity.TENSOR,
                                                                              "test", "fp8_e4m3"))
    assert len(list(source.glob("*.safetensors"))) > 1 and (Path(first) / "kv_cache_scales.safetensors").exists()
    res = calibrate(str(source), [text_file], ScaleRecipe(ScaleGranularity.TENSOR, "amax", E4M3), num_samples=1,
                    seq_len=SEQ, dtype="float32", show_progress=False)
    save_model_with_scales(first, str(tmp_path / "b"), res.scales)      # the source already has (other) scales
    loaded, contents = _cache_contents(str(tmp_path / "b"), [5, 6, 7, 8])
    assert torch.equal(loaded.k, res.scales.k) and torch.equal(loaded.v, res.scales.v)
    index = json.loads((tmp_path / "b" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.1.self_attn.kv_scale"] == "kv_cache_scales.safetensors"
    _, direct = _cache_contents(tiny_models["llama"], [5, 6, 7, 8], quantization_param_path=_kv8_file(res, tmp_path))
    assert _same_contents(contents, direct)


def _kv8_file(res, tmp_path: Path) -> str:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "direct.json")
    write_scales(path, res.scales, res.info, "kv8")
    return path


def test_eval_dynamic_and_rotation_configs(tiny_models: dict[str, str], text_file: str) -> None:
    cfg = KVConfig.from_flags("--kv-cache-dtype fp8_e4m3 --kv-cache-scale-mode dynamic --kv-cache-rotation hadamard")
    assert cfg == KVConfig("fp8_e4m3", kv_cache_scale_mode="dynamic", kv_cache_rotation="hadamard")
    assert cfg.label == "fp8_e4m3+dynamic+hadamard"
    assert cfg.engine_options() == dict(kv_cache_dtype="fp8_e4m3", quantization_param_path=None,
                                        kv_cache_scale_mode="dynamic", kv_cache_rotation="hadamard", quantization=None,
                                        kv_cache_plan=None)
    planned = KVConfig.from_flags("--kv-cache-dtype int8 --kv-cache-plan plan.json")
    assert (planned.kv_cache_plan, planned.label) == ("plan.json", "int8+plan:plan.json")
    scaled = KVConfig.from_flags("--kv-cache-rotation hadamard --kv-cache-dtype=fp8_e5m2 --quantization-param-path "
                                 "'my scales.json'")
    assert (scaled.quantization_param_path, scaled.label) == ("my scales.json", "fp8_e5m2+hadamard:my scales.json")
    for bad, message in (("--kv-cache-dtype fp8_e4m3 --kv-cache-rotation rotate",
                          "kv_cache_rotation='rotate' is not supported; choose none, hadamard, or keys/values apart"),
                         ("--kv-cache-dtype fp8_e4m3 --block-size 32", "unrecognized arguments: --block-size 32"),
                         ("fp8_e4m3+dynamic", "kv_cache_dtype='fp8_e4m3+dynamic' is not supported"),
                         ("--kv-cache-scale-mode dynamic", "names no --kv-cache-dtype")):
        with pytest.raises(ValueError, match=re.escape(message)):
            KVConfig.from_flags(bad)
    assert KVConfig.from_flags(" fp8_e5m2 ") == KVConfig("fp8_e5m2")   # a dtype alone: --kv-cache-dtype X
    weights = KVConfig.from_flags("--kv-cache-dtype fp8_e4m3 --quantization fp8")
    assert (weights.quantization, weights.label) == ("fp8", "fp8_e4m3+fp8-weights")
    assert KVConfig.from_flags("--kv-cache-dtype bfloat16 --quantization gguf").label == "bfloat16+gguf-weights"
    report = evaluate(tiny_models["llama"], [text_file], [cfg, KVConfig("fp8_e4m3"), weights], window=24,
                      num_windows=2, skip_tokens=7, gen_prompts=1, gen_prompt_len=6, gen_tokens=3, dtype="float32",
                      show_progress=False)
    dyn, static, fp8_weights = report.results
    # the same cache with FP8 weights: the weights' error on top of the cache's
    assert fp8_weights.mean_kld > static.mean_kld > 0
    # Per-token scales add 4 bytes per (token, head, K|V) to 16 one-byte values: 20 / 16 of the static size.
    assert dyn.bytes_per_token * 16 == static.bytes_per_token * 20
    assert dyn.mean_kld > 0 and max(dyn.layer_k_rel_err) > 0 and dyn.layer_k_scale_max is None
    # equal windows: the mean KLD is the mean of the windows' means
    assert all(len(r.window_kld) == 2 for r in report.results)
    assert static.mean_kld == pytest.approx(sum(static.window_kld) / 2)
    assert "recommendation: " in report.table()


def _kld_result(label: str, window_kld: list[float], kv: str = "fp8_e4m3") -> ConfigResult:
    return ConfigResult(label=label, kv_cache_dtype=kv, scales_source=None, bytes_per_token=1, perplexity=1.0,
                        delta_ppl=0.0, mean_nll=0.0, mean_kld=sum(window_kld) / len(window_kld), max_kld=1.0,
                        top1_agreement=1.0, greedy_mean_match=None, greedy_identical=None, window_kld=window_kld)


def test_the_recommendation_names_the_lowest_kld_and_what_the_windows_can_tell_apart() -> None:
    def report(*results: ConfigResult) -> EvalReport:
        return EvalReport(model="m", dtype="float32", attention_backend="reference", window=16, num_windows=4,
                          scored_tokens=32, gen_prompts=0, gen_prompt_len=4, gen_tokens=4,
                          reference=_kld_result("float32 (reference)", [0.0] * 4, "float32"), results=list(results))

    best = _kld_result("fp8_e4m3+dynamic", [1.0e-2, 1.2e-2, 0.9e-2, 1.1e-2])
    worse = _kld_result("fp8_e4m3+hadamard", [2.0e-2, 2.3e-2, 1.9e-2, 2.2e-2])      # every window clearly higher
    noisy = _kld_result("fp8_e4m3", [0.5e-2, 2.0e-2, 0.6e-2, 1.9e-2])                # higher on average only
    line = report(_kld_result("bfloat16", [1e-5] * 4, "bfloat16"), best, worse, noisy).recommendation()
    assert line == ("recommendation: fp8_e4m3+dynamic has the lowest KLD of the 3 FP8 configurations (1.05e-02); it "
                    "beats fp8_e4m3+hadamard (2.10e-02) by more than twice the spread between windows; fp8_e4m3 "
                    "(1.25e-02) cannot be told apart from it on these 4 windows (more --num-windows would)")
    assert report(best, _kld_result("bfloat16", [1e-5] * 4, "bfloat16")).recommendation() is None
    assert "recommendation:" not in report(best).table()


def test_calibration_for_a_rotated_cache(tiny_models: dict[str, str], text_file: str, tmp_path: Path) -> None:
    """Scales calibrated with rotation describe the rotated K/V, say so in kv8 JSON, and only load with it."""
    from kv8 import LLM
    from kv8.quant.rotation import hadamard

    model = tiny_models["llama_gqa"]
    recipe = ScaleRecipe(granularity=ScaleGranularity.HEAD, statistic="amax", fmt=E4M3, **RAW)
    kw = dict(num_samples=2, seq_len=16, dtype="float32", show_progress=False)
    plain = calibrate(model, [text_file], recipe, **kw).scales
    rotated = calibrate(model, [text_file], recipe, rotation="hadamard", **kw)
    s = rotated.scales
    assert s.rotation == "hadamard" and "hadamard rotation" in s.source
    # Independent check: amax over tokens and channels of transformers' cached K/V rotated by the Hadamard matrix.
    rot = hadamard(16)
    for i, (k, v) in enumerate(hf_kv(model, hf_windows(model, text_file, 16, 2))):
        torch.testing.assert_close(s.k[i, :, 0], (k @ rot).abs().amax(dim=(0, 2)) / 448.0, rtol=1e-5, atol=0)
        torch.testing.assert_close(s.v[i, :, 0], (v @ rot).abs().amax(dim=(0, 2)) / 448.0, rtol=1e-5, atol=0)
    assert not torch.allclose(s.v, plain.v)
    path = str(tmp_path / "rot.json")
    write_scales(path, s, rotated.info, "kv8")
    ones = torch.ones(2, 1, 1)
    tensor_rot = KVScales(k=ones, v=ones, granularity=ScaleGranularity.TENSOR, source="test", made_for="fp8_e4m3",
                          rotation="hadamard")
    with pytest.raises(ValueError, match="cannot say"):
        write_scales(str(tmp_path / "v.json"), tensor_rot, rotated.info, "vllm")
    with pytest.raises(ValueError, match="cannot say"):
        save_model_with_scales(model, str(tmp_path / "m"), s)
    common = dict(dtype="float32", max_model_len=64, kv_cache_memory="2MiB", kv_cache_dtype="fp8",
                  quantization_param_path=path)
    llm = LLM(model=model, kv_cache_rotation="hadamard", **common)
    assert llm.engine.cache.scales.rotation == "hadamard"
    with pytest.raises(ValueError, match="calibrated with rotation 'hadamard', but kv_cache_rotation='none'"):
        LLM(model=model, **common)


def test_calibration_for_a_cache_that_rotates_one_side(tiny_models: dict[str, str], text_file: str,
                                                       tmp_path: Path) -> None:
    """With ``rotation="none/hadamard"`` the keys' scales are an unrotated calibration's and the values' a rotated
    one's (key envelope included: the keys' basis is the identity); the file records the pair and loads with it."""
    from kv8 import LLM

    model = tiny_models["llama_gqa"]
    recipe = ScaleRecipe(granularity=ScaleGranularity.CHANNEL, statistic="amax", fmt=E4M3)
    kw = dict(num_samples=2, seq_len=16, dtype="float32", show_progress=False)
    plain = calibrate(model, [text_file], recipe, **kw).scales
    both = calibrate(model, [text_file], recipe, rotation="hadamard", **kw).scales
    apart = calibrate(model, [text_file], recipe, rotation="none/hadamard", **kw)
    s = apart.scales
    assert s.rotation == "none/hadamard" and "none/hadamard rotation" in s.source
    assert torch.equal(s.k, plain.k) and torch.equal(s.v, both.v) and not torch.equal(s.v, plain.v)
    path = str(tmp_path / "apart.json")
    write_scales(path, s, apart.info, "kv8")
    common = dict(dtype="float32", max_model_len=64, kv_cache_memory="2MiB", kv_cache_dtype="fp8",
                  quantization_param_path=path)
    assert LLM(model=model, kv_cache_rotation="none/hadamard", **common).engine.cache.scales.rotation == \
        "none/hadamard"
    with pytest.raises(ValueError, match="calibrated with rotation 'none/hadamard', but kv_cache_rotation='hadamard'"):
        LLM(model=model, kv_cache_rotation="hadamard", **common)


def test_calibrate_and_eval_on_a_sliding_window_model(tiny_models: dict[str, str], text_file: str) -> None:
    """Gemma 3 (local layers of window 16, one global layer) with windows of 40 tokens, so the tools' own caches
    hold sliding-window groups: eval's perplexity equals transformers', calibration gives every layer scales,
    rotated too (head_dim 32)."""

    model = tiny_models["gemma3"]
    window, n = 40, 2
    report = evaluate(model, [text_file], [KVConfig("float32"), KVConfig("fp8_e4m3", kv_cache_rotation="hadamard")],
                      window=window,
                      num_windows=n, skip_tokens=7, gen_prompts=1, gen_prompt_len=20, gen_tokens=5, dtype="float32",
                      max_num_batched_tokens=16, show_progress=False)
    nll = hf_scored_nll(model, text_file, window, n, skip=7)
    assert report.reference.perplexity == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    same, rotated = report.results
    assert same.mean_kld == pytest.approx(0.0, abs=1e-12) and rotated.mean_kld > 0
    for rotation in ("none", "hadamard"):
        res = calibrate(model, [text_file], ScaleRecipe(ScaleGranularity.HEAD, "amax", E4M3), num_samples=2,
                        seq_len=window, dtype="float32", rotation=rotation, show_progress=False)
        assert res.scales.k.shape[0] == res.scales.v.shape[0] == 4
        assert bool((res.scales.k > 0).all()) and bool((res.scales.v > 0).all())


@pytest.mark.parametrize("statistic", ["amax", "percentile", "mse"])
def test_per_rank_scales_come_from_each_ranks_heads(tiny_models: dict[str, str], text_file: str, tmp_path: Path,
                                                    statistic: str) -> None:
    """--tensor-parallel-size N: rank r's per-layer scale is the recipe's statistic over the KV heads rank r holds
    (a collector fed only those heads is the oracle), the all-heads scales equal a one-rank calibration, and a
    vLLM file with ``scaling_factor[tp_rank]`` gives each rank its own."""
    from kv8.tools.kv_stats import KVStatsCollector

    model = tiny_models["llama_gqa"]                                       # 6 query heads, 2 KV heads
    recipe = ScaleRecipe(ScaleGranularity.TENSOR, statistic, E4M3, percentile=90.0, **RAW)
    kw = dict(num_samples=SAMPLES, seq_len=SEQ, dtype="float32", show_progress=False)
    one = calibrate(model, [text_file], recipe, **kw)
    two = calibrate(model, [text_file], recipe, tensor_parallel_size=2, **kw)
    assert one.rank_scales is None and two.rank_scales is not None and len(two.rank_scales) == 2
    torch.testing.assert_close(two.scales.k, one.scales.k, rtol=0, atol=0)
    torch.testing.assert_close(two.scales.v, one.scales.v, rtol=0, atol=0)
    kv = hf_kv(model, hf_windows(model, text_file, SEQ, SAMPLES))
    for rank in range(2):
        oracle = KVStatsCollector(len(kv), 1, kv[0][0].shape[2], None if statistic == "amax" else
                                  ScaleGranularity.TENSOR, "observed")
        for i, (k, v) in enumerate(kv):
            oracle.observe(i, k[:, rank:rank + 1], v[:, rank:rank + 1])
        want = oracle.scales(recipe, "oracle")
        got = two.rank_scales[rank]
        assert got.granularity is ScaleGranularity.TENSOR and f"rank {rank} of 2" in got.source
        torch.testing.assert_close(got.k, want.k, rtol=1e-5, atol=0)
        torch.testing.assert_close(got.v, want.v, rtol=1e-5, atol=0)
    assert not torch.equal(two.rank_scales[0].k, two.rank_scales[1].k)      # the ranks' heads differ
    path = tmp_path / "ranks.json"
    write_scales(str(path), two.scales, two.info, "vllm", two.rank_scales)
    assert sorted(json.loads(path.read_text())["kv_cache"]["scaling_factor"]) == ["0", "1"]
    for rank, rs in enumerate(two.rank_scales):
        loaded = load_scales_file(path, two.info, tp_rank=rank, tp_size=2)
        torch.testing.assert_close(loaded.k, torch.maximum(rs.k, rs.v), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="holds 2 tensor-parallel ranks|tensor-parallel size 1"):
        load_scales_file(path, two.info)
    with pytest.raises(ValueError, match="no per-rank scales"):
        write_scales(str(tmp_path / "k.json"), two.scales, two.info, "kv8", two.rank_scales)


def test_per_rank_calibration_with_replicated_kv_heads_and_bad_sizes(tiny_models: dict[str, str], text_file: str,
                                                                    tmp_path: Path, capsys) -> None:
    """With fewer KV heads than ranks each head's scales go to the ranks that replicate it (vLLM's rule), from the
    command line; sizes that do not split the model and kv8 JSON output are refused before any work."""
    model = tiny_models["llama_gqa"]                                       # 6 query heads, 2 KV heads
    out = tmp_path / "six.json"
    base = ["calibrate", model, "--data", text_file, "--num-samples", "2", "--seq-len", str(SEQ), "--dtype",
            "float32", "--scale-rounding", "none", "--no-progress"]
    assert main(base + ["--tensor-parallel-size", "6", "--output", str(out)]) == 0
    assert "for 6 tensor-parallel ranks" in capsys.readouterr().out
    factors = json.loads(out.read_text())["kv_cache"]["scaling_factor"]
    assert sorted(factors) == [str(r) for r in range(6)]
    assert factors["0"] == factors["1"] == factors["2"] and factors["3"] == factors["4"] == factors["5"]
    assert factors["0"] != factors["3"]
    assert main(base + ["--tensor-parallel-size", "4", "--output", str(tmp_path / "x.json")]) == 2
    assert "tensor_parallel_size=4 must divide the model's num_attention_heads=6" in capsys.readouterr().err
    assert main(base + ["--tensor-parallel-size", "2", "--output-format", "kv8", "--output",
                        str(tmp_path / "y.json")]) == 2
    assert "no per-rank scales" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "y.json").exists()
