"""The CLI (thin layer over EngineArgs) and the config validation it relies on."""

from __future__ import annotations

import json

import pytest
import torch

from kv8.engine.config import resolve_dtype
from kv8.entrypoints.cli import build_parser, main
from kv8.layers.rotary import RopeScaling
from kv8.models.registry import arch_config
from kv8.validators import parse_memory


def test_generate_and_info_on_a_tiny_model(tiny_llama, capsys):
    assert main(["generate", "Paris is the", "London is", "--model", tiny_llama, "--max-tokens", "5",
                 "--ignore-eos", "--kv-cache-dtype", "fp8_e5m2", "--kv-cache-memory", "4MiB",
                 "--max-model-len", "128", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["prompt"] for x in lines] == ["Paris is the", "London is"]
    assert all(len(x["token_ids"]) == 5 and x["finish_reason"] == "length" for x in lines)
    # --chat applies the chat template to every prompt (each its own conversation)
    from kv8 import LLM, SamplingParams

    assert main(["generate", "Paris is the", "London is", "--chat", "--model", tiny_llama, "--max-tokens", "5",
                 "--ignore-eos", "--kv-cache-memory", "4MiB", "--max-model-len", "128", "--json"]) == 0
    chat = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    llm = LLM(tiny_llama, kv_cache_memory="4MiB", max_model_len=128)
    expected = llm.chat([[{"role": "user", "content": p}] for p in ("Paris is the", "London is")],
                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [x["token_ids"] for x in chat] == [o.outputs[0].token_ids for o in expected]
    assert main(["info", tiny_llama, "--kv-cache-memory", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "2 layers" in out and "4 query / 4 KV heads" in out
    from kv8.kernels.cpu.dense import describe_dense_kernels

    kernels = next(line for line in out.splitlines() if line.startswith("dense kernels "))
    assert kernels == f"dense kernels {describe_dense_kernels()}"
    assert kernels.split()[2] in ("avx512", "avx2", "unavailable:")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("bfloat16", "fp8"))}
    assert int(rows["fp8_e4m3"][3]) == 2 * int(rows["bfloat16"][3])       # twice the tokens
    assert int(rows["fp8_e4m3"][1]) == 2 * 2 * 4 * 16                       # K+V x layers x heads x dim bytes


def test_cli_errors_are_clear(tiny_llama, capsys):
    assert main(["generate", "x", "--model", "/nonexistent/model"]) == 2
    assert "does not download" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "x", "--kv-cache-dtype", "int2"])
    assert "argument --kv-cache-dtype: kv_cache_dtype='int2' is not supported; choose one of:" in \
        capsys.readouterr().err


def test_a_cache_larger_than_free_memory_or_too_few_blocks_are_clear_errors(tiny_llama, capsys):
    """--kv-cache-memory beyond the machine: `kv8: error:` saying how much is free, exit 2, before allocating;
    --num-kv-blocks too small names num_kv_blocks (not kv_cache_memory, which the user did not set)."""
    from kv8.validators import memory_available as free_memory

    free = free_memory()
    assert free is not None                      # Linux: /proc/meminfo
    assert main(["generate", "x", "--model", tiny_llama, "--kv-cache-memory", "100TiB", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kv8: error: kv_cache_memory=100.00 TiB (--kv-cache-memory) asks for a KV cache of ")
    assert "of memory is free on this machine (the model's weights loaded); lower it" in err and "Traceback" not in err
    assert main(["generate", "x", "--model", tiny_llama, "--num-kv-blocks", "10", "--max-model-len", "256"]) == 2
    err = capsys.readouterr().err
    assert "num_kv_blocks=10 (--num-kv-blocks)" in err and "raise num_kv_blocks to at least 16" in err
    assert "kv_cache_memory" not in err


def test_broken_model_files_are_errors_naming_the_file(tiny_llama, tmp_path, capsys):
    """Truncated or corrupt safetensors, a directory without tokenizer files, a scales JSON nested 100,000 deep and
    num_hidden_layers 0: `kv8: error: <file>: <what is wrong>`, exit 2, no traceback."""
    import os
    import shutil

    def copy(name):
        d = tmp_path / name
        shutil.copytree(tiny_llama, d)
        return d

    def run(model, *extra):
        code = main(["generate", "x", "--model", str(model), "--num-kv-blocks", "8", "--max-model-len", "64",
                     "--max-tokens", "1", *extra])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("kv8: error: ") and "Traceback" not in err, err
        return err

    truncated = copy("truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert f"{weights}: not a valid safetensors file" in run(truncated) and "truncated or corrupt" in run(truncated)
    corrupt = copy("corrupt")
    raw = bytearray((corrupt / "model.safetensors").read_bytes())
    raw[8:40] = b"x" * 32                                   # the JSON header
    (corrupt / "model.safetensors").write_bytes(bytes(raw))
    assert f"{corrupt / 'model.safetensors'}: not a valid safetensors file" in run(corrupt)
    no_tokenizer = copy("no_tokenizer")
    for name in os.listdir(no_tokenizer):
        if name.startswith("tokenizer"):
            os.remove(no_tokenizer / name)
    err = run(no_tokenizer)
    assert f"{no_tokenizer}: no tokenizer files (looked for tokenizer.json, tokenizer.model" in err
    deep = tmp_path / "deep.json"
    for doc in ("[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000):
        deep.write_text(doc)
        err = run(tiny_llama, "--kv-cache-dtype", "fp8", "--quantization-param-path", str(deep))
        assert f"{deep}: not a KV cache scales file: its JSON is nested too deeply" in err
    no_layers = copy("no_layers")
    cfg = json.loads((no_layers / "config.json").read_text())
    (no_layers / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 0}))
    assert "num_hidden_layers=0 must be an int >= 1" in run(no_layers)


def test_messages_name_what_the_user_set(tiny_llama, tmp_path, capsys, caplog):
    """Scales with the default kv_cache_dtype name 'auto' (not the dtype it resolved to); the dtype aliases are
    listed once; E4M3 scales on an fp8_e5m2 cache are logged; too little data names --window."""
    import logging

    import torch

    from kv8 import LLM
    from kv8.quant.formats import KV_CACHE_DTYPE_NAMES
    from kv8.quant.scale_files import write_vllm_scales_json
    from kv8.quant.scales import KVScales, ScaleGranularity

    assert main(["generate", "x", "--model", tiny_llama, "--num-kv-blocks", "8", "--max-model-len", "64",
                 "--quantization-param-path", "s.json"]) == 2
    err = capsys.readouterr().err
    assert "kv_cache_dtype='auto' (the bfloat16 compute dtype) is not an FP8 format" in err, err
    assert len(KV_CACHE_DTYPE_NAMES) == len(set(KV_CACHE_DTYPE_NAMES))
    with pytest.raises(SystemExit):
        main(["generate", "x", "--kv-cache-dtype", "int2"])
    assert capsys.readouterr().err.count(" fp8,") == 1   # listed once, not as a choice and again as an alias
    scales = tmp_path / "scales.json"
    ones = torch.ones(2, 1, 1)
    write_vllm_scales_json(scales, KVScales(ones, ones, ScaleGranularity.TENSOR, "test", "fp8_e4m3"), "llama")
    with caplog.at_level(logging.WARNING, logger="kv8"):
        LLM(tiny_llama, kv_cache_dtype="fp8_e5m2", quantization_param_path=str(scales), num_kv_blocks=8,
            max_model_len=64)
    assert any("calibrated for fp8_e4m3 but the cache stores fp8_e5m2" in r.getMessage() for r in caplog.records)
    (tmp_path / "short.txt").write_text("a few words only")
    assert main(["eval", tiny_llama, "--data", str(tmp_path / "short.txt"), "--config", "fp8",
                 "--window", "64", "--num-windows", "1", "--gen-prompts", "0"]) == 2
    assert "smaller --window" in capsys.readouterr().err


def test_help_is_readable(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--kv-cache-dtype", "--quantization-param-path", "--max-tokens", "examples:"):
        assert flag in text


@pytest.mark.parametrize("value,expected", [(1024, 1024), ("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2),
                                            ("1.5GB", 1_500_000_000), ("1000", 1000)])
def test_parse_memory(value, expected):
    assert parse_memory(value) == expected


@pytest.mark.parametrize("value", ["lots", "-1GiB", 0, -5, True, "2 parsecs", None])
def test_parse_memory_rejects(value):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_memory(value)


def test_dtype_names():
    assert resolve_dtype("auto") == torch.bfloat16 and resolve_dtype("float32") == torch.float32
    with pytest.raises(ValueError, match="dtype='int8'.*bfloat16"):
        resolve_dtype("int8")


def test_arch_config_validation():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2)
    arch = arch_config(base)
    assert arch.head_dim == 4 and arch.gqa_ratio == 1 and not arch.attention_bias
    assert arch_config({**base, "model_type": "qwen2"}).attention_bias
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        arch_config({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        arch_config({**base, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="missing the key 'vocab_size'"):
        arch_config({k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        RopeScaling.from_dict({"rope_type": "yarn", "factor": 2.0})


@pytest.mark.parametrize("change,message", [
    ({"rope_theta": -1}, r"rope_theta=-1\.0 must be a finite number > 0"),
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps=nan must be a finite number > 0"),
    ({"hidden_size": -1}, r"hidden_size=-1 must be an int >= 1"),
    ({"num_hidden_layers": 0}, r"num_hidden_layers=0 must be an int >= 1"),
    ({"hidden_size": "8"}, r"hidden_size='8' must be an integer"),
    ({"eos_token_id": "x"}, r"eos_token_id='x' must be an int"),
    ({"sliding_window": -3}, r"sliding_window=-3 must be an int >= 1"),
    ({"rope_scaling": {"rope_type": "linear"}}, r"rope_scaling \(linear\) is missing the key 'factor'"),
])
def test_arch_config_rejects_bad_values(change, message):
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(ValueError, match=message):
        arch_config({**base, **change})
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        arch_config([base])  # type: ignore[arg-type]


def test_model_type_from_architectures_and_cli_dtype_aliases(tiny_models, capsys):
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, architectures=["Qwen2ForCausalLM"])
    arch = arch_config(base)   # no model_type: taken from architectures
    assert arch.model_type == "qwen2" and arch.attention_bias
    assert main(["generate", "x", "--model", tiny_models["llama"], "--num-kv-blocks", "8", "--max-model-len", "64",
                 "--max-tokens", "2", "--dtype", "float32", "--kv-cache-dtype", "fp8_e4m3fn"]) == 0
    capsys.readouterr()


def test_a_layer_count_the_checkpoint_does_not_hold_is_refused_before_building(tiny_llama, tmp_path, capsys):
    import shutil

    bad = tmp_path / "m"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    for layers in (1_000_000_000, cfg["num_hidden_layers"] + 1):
        (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}))
        assert main(["generate", "x", "--model", str(bad), "--num-kv-blocks", "8", "--max-model-len", "64"]) == 2
        err = capsys.readouterr().err
        assert f"num_hidden_layers={layers}" in err and "checkpoint holds layers model.layers.0" in err


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    """kv8's inverse frequencies equal transformers' for llama3 and linear scaling."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kv8.layers.rotary import rope_inv_freq

    for rs in ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, {"rope_type": "linear", "factor": 4.0}):
        cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=512,
                          rope_scaling=dict(rs, rope_theta=10000.0), rope_theta=10000.0)
        expected, _ = ROPE_INIT_FUNCTIONS[rs["rope_type"]](cfg, "cpu")
        arch = arch_config({**cfg.to_dict(), "rope_scaling": rs, "rope_theta": 10000.0})
        got = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)


def test_python_m_kv8_version_and_a_named_kernel_that_cannot_build(tiny_llama, tmp_path):
    """``python -m kv8`` is the CLI; ``--version`` prints it; asking by name for kernels that cannot be built is a
    one-line error and exit 2, not a traceback."""
    import os
    import subprocess
    import sys

    from kv8 import __version__

    run = [sys.executable, "-m", "kv8"]
    out = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"kv8 {__version__}"
    env = {**os.environ, "CXX": "kv8-no-such-compiler", "KV8_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([*run, "generate", "hi", "--model", tiny_llama, "--num-kv-blocks", "8", "--max-tokens", "2",
                          "--max-model-len", "64", "--dense-backend", "torch", "--attention-backend", "cpu_fused"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("kv8: error: ") and "compiler" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
