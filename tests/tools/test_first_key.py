"""Key offsets aligned to the first position's key (:mod:`kv8.tools.first_key`, ``kv8 calibrate --align-first-key``).

The oracle for "stored exactly" is the codec's own round trip (:meth:`KVCodec.round_trip`, itself tested against
numpy / ml_dtypes references in tests/quant); the calibration's first keys are checked against transformers' keys at
position 0 of each window.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kv8.attention.metadata import AttentionMetadata
from kv8.cache.codec import K, KVCodec
from kv8.entrypoints.cli import main
from kv8.quant.formats import E4M3, resolve_kv_cache_dtype
from kv8.quant.key_offsets import KeyOffsets
from kv8.quant.key_scaling import KeyScaling
from kv8.quant.scale_files import load_key_offsets
from kv8.quant.scales import ModelScaleInfo, ScaleGranularity
from kv8.tools.calibrate import calibrate
from kv8.tools.data import require_bos, start_with_bos
from kv8.tools.evaluate import KVConfig, evaluate
from kv8.tools.first_key import GAIN, FirstKeyCollector, align_to_first_key, check_alignable
from kv8.tools.kv_stats import ScaleRecipe
from tests.helpers.calibration import hf_kv, hf_scored_nll, hf_windows

FORMATS = ("int8", "int4", "int4_per_group32", "fp4_e2m1")


def _stored_error(kv: str, rotation: str, offsets: torch.Tensor, scaling: torch.Tensor | None, keys: torch.Tensor,
                  layer: int) -> torch.Tensor:
    """Per-head squared round-trip error ``[N, H]`` of model-basis keys ``[N, H, D]`` stored with these offsets."""
    codec = KVCodec.build(resolve_kv_cache_dtype(kv, torch.float32), keys.shape[-1], rotation=rotation,
                          key_offsets=KeyOffsets(offsets, "t"),
                          key_scaling=None if scaling is None else KeyScaling(scaling, "t"))
    x = codec.keys_to_stored(keys, layer)
    back, _ = codec.round_trip(x, layer, K)
    return (back - x).pow(2).sum(dim=-1)


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
@pytest.mark.parametrize("kv", FORMATS)
def test_a_constant_first_key_is_stored_exactly_and_a_varying_one_keeps_the_mean(kv: str, rotation: str) -> None:
    """Head 0's first key is the same in every window: its offset moves, the key then round-trips with no error
    (to float32 rounding of the centering and rotation), and the offset moved by less than the key's rounding error
    under the mean offset allows. Head 1's first key varies as much as the keys do: its offset stays the mean, bit
    for bit."""
    g = torch.Generator().manual_seed(0)
    layers, heads, d, n = 2, 2, 64, 6
    offsets = torch.randn(layers, heads, d, generator=g) * 3
    scaling = torch.exp(torch.randn(layers, heads, d, generator=g) * 0.3)
    sink = torch.randn(layers, heads, d, generator=g) * 8 + offsets
    first = sink.expand(n, layers, heads, d).clone()
    first[:, :, 1] += torch.randn(n, layers, d, generator=g) * 8
    res = align_to_first_key(KeyOffsets(offsets, "mean"), KeyScaling(scaling, "s"), first,
                          resolve_kv_cache_dtype(kv, torch.float32), rotation)
    assert res.aligned.tolist() == [[True, False], [True, False]]
    assert torch.equal(res.offsets.k[:, 1], offsets[:, 1])
    assert "aligned to the first position's key" in res.offsets.source and "in 2 of 4 heads" in res.offsets.source
    for layer in range(layers):
        after = _stored_error(kv, rotation, res.offsets.k, scaling, first[:, layer], layer)
        before = _stored_error(kv, rotation, offsets, scaling, first[:, layer], layer)
        assert float(after[:, 0].max()) <= 1e-6 * float(before[:, 0].min()), (after[:, 0], before[:, 0])
        torch.testing.assert_close(res.error_before[layer], before.mean(0) / d, rtol=1e-5, atol=0)
        # the shift is the sink's rounding error mapped back (R orthonormal, divided by the factors)
        shift = ((res.offsets.k[layer, 0] - offsets[layer, 0]) * scaling[layer, 0]).pow(2).sum()
        assert float(shift) <= float(before[0, 0]) * (1 + 1e-4)


def test_a_head_aligns_only_when_its_first_keys_error_falls_by_the_gain() -> None:
    """Noise of the first key around its mean, just above and far below the grid's step, decides: the head whose
    aligned error is not below GAIN times the mean offset's keeps the mean offset."""
    g = torch.Generator().manual_seed(1)
    layers, heads, d, n = 1, 3, 32, 8
    offsets = torch.zeros(layers, heads, d)
    sink = torch.randn(layers, heads, d, generator=g) * 4
    first = sink.expand(n, layers, heads, d).clone()
    step = float(sink.abs().max()) / 7                       # int4 per group: about amax / 7 between levels
    for h, noise in enumerate((0.0, 1e-3 * step, 2.0 * step)):
        first[:, :, h] += torch.randn(n, layers, d, generator=g) * noise
    res = align_to_first_key(KeyOffsets(offsets, "mean"), None, first,
                          resolve_kv_cache_dtype("int4_per_group32", torch.float32), "none")
    assert res.aligned[0].tolist() == [True, True, False]
    ratio = res.error_after / res.error_before
    assert bool((ratio[res.aligned] <= GAIN).all()) and bool((ratio[~res.aligned] > GAIN).all())


def test_formats_with_scales_set_before_the_offsets_or_none_are_refused() -> None:
    for name in ("fp8_e4m3", "fp8_e5m2", "bfloat16", "float32"):
        with pytest.raises(ValueError, match=f"--align-first-key {name}: the first key can be aligned to a format"):
            check_alignable(resolve_kv_cache_dtype(name, torch.float32))
    for name in FORMATS:
        check_alignable(resolve_kv_cache_dtype(name, torch.float32))
    with pytest.raises(ValueError, match=r"first keys must be \[N >= 1, 1, 1, 32\]"):
        align_to_first_key(KeyOffsets(torch.zeros(1, 1, 32), "m"), None, torch.zeros(0, 1, 1, 32),
                        resolve_kv_cache_dtype("int8", torch.float32), "none")


def test_first_position_rows_name_the_tokens_at_position_zero() -> None:
    """A batch of a whole prompt, a prompt's second chunk, a decode step and a prompt's first chunk."""
    meta = AttentionMetadata.build([5, 3, 1, 4], [5, 11, 20, 4], [[0], [1], [2, 3], [4]], 16)
    assert meta.first_position_rows() == [0, 9]
    assert AttentionMetadata.build([1], [7], [[0]], 16).first_position_rows() == []
    collector = FirstKeyCollector(2)
    collector.observe(0, torch.ones(2, 1, 4))
    with pytest.raises(ValueError, match="every layer must see the same windows"):
        collector.stacked()


def test_calibrate_records_each_windows_first_key_and_writes_the_aligned_offsets(
        tiny_models: dict[str, str], text_file: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The first keys calibration sees are transformers' keys at position 0 of each window; the file's offsets are
    the alignment's (the mean key, from transformers, where no head moved); --align-first-key needs
    --key-centering and a format it can align to, and is refused with --plan."""
    model, seq, samples = tiny_models["llama_gqa"], 32, 3
    recipe = ScaleRecipe(ScaleGranularity.TENSOR, "amax", E4M3)
    res = calibrate(model, [text_file], recipe, num_samples=samples, seq_len=seq, dtype="float32",
                    key_centering=True, align_first_key="int4", rotation="hadamard", show_progress=False)
    assert res.first_key is not None and res.key_offsets is res.first_key.offsets
    hf = hf_kv(model, hf_windows(model, text_file, seq, samples))
    for layer, (k, _) in enumerate(hf):
        torch.testing.assert_close(res.first_key.first_keys[:, layer], k[0::seq], atol=1e-5, rtol=1e-5)
        kept = ~res.first_key.aligned[layer]
        torch.testing.assert_close(res.key_offsets.k[layer][kept], k.mean(dim=0)[kept], atol=1e-5, rtol=1e-5)
    out = tmp_path / "aligned.json"
    assert main(["calibrate", model, "--data", text_file, "--num-samples", str(samples), "--seq-len", str(seq),
                 "--dtype", "float32", "--key-centering", "--kv-cache-rotation", "hadamard", "--align-first-key",
                 "int4", "--output", str(out), "--no-progress"]) == 0
    assert "first-position key aligned in" in capsys.readouterr().out
    loaded = load_key_offsets(out, ModelScaleInfo("llama", 2, 2, 16))
    assert loaded is not None
    torch.testing.assert_close(loaded.k, res.key_offsets.k, atol=1e-6, rtol=0)
    for args, message in (
            (["--align-first-key", "int4"], "--align-first-key int4: it moves key offsets; add --key-centering"),
            (["--key-centering", "--align-first-key", "fp8_e4m3"],
             "--align-first-key fp8_e4m3: the first key can be aligned to a format"),
            (["--key-centering", "--align-first-key", "int3"], "align_first_key (--align-first-key): "),
            (["--plan", "--kld-budget", "1", "--align-first-key", "int4"],
             "--align-first-key does not apply to --plan")):
        assert main(["calibrate", model, "--data", text_file, "--output", str(tmp_path / "x.json"), *args]) == 2
        err = capsys.readouterr().err
        assert message in err, err


def test_windows_that_start_with_bos_share_their_first_key_so_every_head_aligns(
        tiny_models: dict[str, str], text_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--add-bos puts the model's BOS token at position 0 of every window (as llama-perplexity does): the first keys
    are then the same in every window and every layer, so every head's offset moves and its first key is stored
    exactly; eval scores such windows as transformers does; a model without a BOS token is refused by name."""
    model, seq, samples = tiny_models["llama_gqa"], 32, 3
    res = calibrate(model, [text_file], ScaleRecipe(ScaleGranularity.TENSOR, "amax", E4M3), num_samples=samples,
                    seq_len=seq, dtype="float32", key_centering=True, align_first_key="int4", add_bos=True,
                    show_progress=False)
    assert res.first_key is not None
    first = res.first_key.first_keys
    torch.testing.assert_close(first, first[:1].expand_as(first), atol=1e-6, rtol=0)
    assert bool(res.first_key.aligned.all())
    assert float(res.first_key.error_after.max()) <= 1e-6 * float(res.first_key.error_before.min())
    bos = 1   # the tiny models' bos_token_id
    windows = [[bos, *w[1:]] for w in hf_windows(model, text_file, seq, samples)]
    for layer, (k, _) in enumerate(hf_kv(model, windows)):
        torch.testing.assert_close(first[:, layer], k[0::seq], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"--add-bos: the model's config names no BOS token"):
        require_bos(None)
    assert require_bos(0) == 0
    assert start_with_bos([[5, 6, 7], [8, 9]], 1) == [[1, 6, 7], [1, 9]]
    report = evaluate(model, [text_file], [KVConfig("fp8_e4m3")], window=16, num_windows=2, gen_prompts=0,
                      dtype="float32", add_bos=True, show_progress=False)
    nll = hf_scored_nll(model, text_file, 16, 2, bos=bos)
    assert report.reference.perplexity == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    assert main(["calibrate", model, "--data", text_file, "--output", "x.json", "--plan", "--kld-budget", "1",
                 "--add-bos"]) == 2
    assert "--add-bos does not apply to --plan" in capsys.readouterr().err
