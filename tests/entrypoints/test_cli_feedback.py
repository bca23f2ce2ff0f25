"""What the command line tells its user (issue 14, item 21): kernels compiling say so once, ``kv8 generate``
streams a single prompt and ``-v`` prints its timings, ``kv8 eval`` keeps the command line's order and shows
``-`` for greedy metrics it did not measure, and the plot's error panel has labelled y ticks."""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import pytest

from kv8 import LLM, SamplingParams, envs
from kv8.entrypoints.cli import main
from tests.helpers.tiny_models import POISONED_TOKEN

TEXT = ("The quick brown fox jumps over the lazy dog. London is the capital of England. Paris is the capital of "
        "France, and Berlin is the capital of Germany. Once upon a time there was a little model. ") * 6


@pytest.mark.skipif(shutil.which(envs.cxx()) is None, reason="no C++ compiler")
def test_compiling_kernels_says_so_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from kv8.kernels.cpu import build

    monkeypatch.setenv("KV8_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_announced", False)
    for value in (1, 2):   # two different libraries compiled in one process: one message
        src = tmp_path / f"lib{value}.cpp"
        src.write_text(f'extern "C" int value(void) {{ return {value}; }}\n')
        build.build_shared_library(src, "x86-64")
    err = capsys.readouterr().err
    assert err.count("kv8: compiling kv8's CPU kernels (first use, about a minute") == 1
    monkeypatch.setattr(build, "_announced", False)
    build.build_shared_library(tmp_path / "lib1.cpp", "x86-64")   # cached: silent
    assert capsys.readouterr().err == ""


class _Writes(io.StringIO):
    """stdout that records each write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_generate_streams_one_prompt_and_verbose_prints_timings(tiny_llama: str, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--model", tiny_llama, "--max-tokens", "12", "--ignore-eos", "--num-kv-blocks", "16",
             "--max-model-len", "128", "--dtype", "float32"]
    ref = LLM(tiny_llama, num_kv_blocks=16, max_model_len=128, dtype="float32").generate(
        "Paris is", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    out = _Writes()
    monkeypatch.setattr("sys.stdout", out)
    assert main(["generate", "Paris is", *flags, "-v"]) == 0
    monkeypatch.undo()
    assert out.getvalue() == "Paris is" + ref.outputs[0].text + "\n"
    pieces = [w for w in out.writes if w and w != "\n"]
    assert len(pieces) >= 4, pieces          # the prompt, then the text as it is generated
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("kv8: ") and "time to first token" in x)
    assert f"{len(ref.prompt_token_ids)} prompt tokens, 12 generated in " in line
    assert "ms; prefill " in line and " tok/s; decode " in line and line.endswith(" tok/s")
    # several prompts: printed at the end (batched), timings too
    assert main(["generate", "Paris is", "London is", *flags, "--verbose"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == "Paris is" + ref.outputs[0].text
    assert "24 generated" in captured.err


def test_generate_says_when_the_model_gives_non_finite_logits(nan_llama: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A prompt whose logits are NaN: ``kv8 generate`` names the cause (not a kernel's error code) and exits 1;
    ``--json`` carries the error beside finish_reason "error"; the other prompt of the batch is printed as usual."""
    from transformers import AutoTokenizer

    poisoned = AutoTokenizer.from_pretrained(nan_llama).decode([POISONED_TOKEN])
    flags = ["--model", nan_llama, "--max-tokens", "3", "--num-kv-blocks", "16", "--max-model-len", "128",
             "--dtype", "float32"]
    assert main(["generate", poisoned, *flags]) == 1
    err = capsys.readouterr().err
    assert "kv8: error: generation failed for prompt 0: the model produced non-finite logits (NaN or inf)" in err
    assert "weights or config are broken" in err and "kernel" not in err
    assert main(["generate", "Paris is", poisoned, "--json", *flags]) == 1
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines()]
    assert records[0]["finish_reason"] == "length" and "error" not in records[0]
    assert records[1]["finish_reason"] == "error" and "non-finite logits" in records[1]["error"]
    assert "generation failed for prompt 1:" in captured.err


def test_eval_rows_follow_the_command_line_and_unmeasured_greedy_is_a_dash(tiny_llama: str, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    report_path = tmp_path / "r.json"
    assert main(["eval", tiny_llama, "--data", str(data), "--config", "fp8_e5m2",
                 "--config", "--kv-cache-dtype fp8_e4m3", "--config", "bfloat16", "--window", "16",
                 "--num-windows", "1", "--gen-prompts", "0",
                 "--json", str(report_path), "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "nan" not in table.lower()
    text = report_path.read_text()
    assert "NaN" not in text                                   # strict JSON
    report = json.loads(text)
    assert [r["label"] for r in report["results"]] == ["fp8_e5m2", "fp8_e4m3", "bfloat16"]
    assert report["results"][0]["greedy_mean_match"] is None
    data_rows = [line for line in table.splitlines() if line.startswith(("fp8_e5m2", "fp8_e4m3", "bfloat16"))]
    assert [line.split()[0] for line in data_rows] == ["fp8_e5m2", "fp8_e4m3", "bfloat16"]
    assert all(line.split()[6:8] == ["-", "-"] for line in data_rows)


def test_plot_error_panel_has_y_ticks(tiny_llama: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kv8.tools.evaluate import ConfigResult, EvalReport
    from kv8.tools.plot import make_figure

    def result(label: str, errs: list[float]) -> ConfigResult:
        return ConfigResult(label=label, kv_cache_dtype=label, scales_source=None, bytes_per_token=1,
                            perplexity=10.0, delta_ppl=0.1, mean_nll=2.0, mean_kld=1e-3, max_kld=1e-2,
                            top1_agreement=0.99, greedy_mean_match=None, greedy_identical=None,
                            layer_k_rel_err=errs, layer_v_rel_err=[e * 1.5 for e in errs], layer_k_clipped=[0.0] * 2,
                            layer_v_clipped=[0.0] * 2, layer_k_scale_max=None, layer_v_scale_max=None)

    for sets in ([[0.021, 0.034], [0.042, 0.06]], [[0.0, 0.0], [0.03, 0.05]]):   # an exact 16-bit cache too
        results = [result(f"c{i}", errs) for i, errs in enumerate(sets)]
        report = EvalReport(model="m", dtype="float32", attention_backend="reference", window=16, num_windows=1,
                            scored_tokens=8, gen_prompts=0, gen_prompt_len=4, gen_tokens=4,
                            reference=result("float32", [0.0, 0.0]), results=results)
        fig = make_figure(report)
        fig.canvas.draw()
        ax = fig.axes[1]
        lo, hi = ax.get_ylim()
        ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert len(ticks) >= 2 and len(labels) >= 2, (ticks, labels)
        assert not any(math.isnan(t) for t in ticks)
