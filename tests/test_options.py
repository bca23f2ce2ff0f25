"""Engine options are declared once (EngineArgs fields) and every CLI subcommand's engine flags come from them."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

import pytest

from kv8.cache.codec import ROTATIONS, SCALE_MODES
from kv8.engine.args import EngineArgs
from kv8.engine.config import (
    ATTENTION_BACKENDS,
    DENSE_BACKENDS,
    DTYPE_CHOICES,
    LOAD_FORMATS,
    QUANTIZATION_CHOICES,
)
from kv8.entrypoints.cli import INFO_OPTIONS, TUNE_OPTIONS, build_parser
from kv8.platform import DEVICE_CHOICES
from kv8.tools.commands import CALIBRATE_EXCLUDED, EVAL_DEFAULTS, EVAL_EXCLUDED

FIELDS = EngineArgs.field_names()
# the command line each subcommand needs besides engine flags
BASE_ARGV = {"generate": ["generate", "hi"], "serve": ["serve"], "run": ["run", "m"], "info": ["info", "m"],
             "tune": ["tune", "m"], "calibrate": ["calibrate", "m", "--data", "d.txt"],
             "eval": ["eval", "m", "--data", "d.txt"]}
OFFERED = {"generate": set(FIELDS), "serve": set(FIELDS), "run": set(FIELDS), "info": {"model", *INFO_OPTIONS},
           "tune": {"model", *TUNE_OPTIONS},
           "calibrate": set(FIELDS) - set(CALIBRATE_EXCLUDED), "eval": set(FIELDS) - set(EVAL_EXCLUDED)}
# a value other than the default for every field, and its flags
OTHER = dict(model="some-model", dtype="float32", kv_cache_dtype="fp8_e5m2", quantization_param_path="s.json",
             kv_cache_memory="3GiB", gpu_memory_utilization=0.5, num_kv_blocks=7, block_size=32,
             enable_prefix_caching=False, max_num_seqs=3, max_num_batched_tokens=99, max_model_len=77, seed=5,
             attention_backend="reference",
             dense_backend="packed_bf16", kv_cache_scale_mode="dynamic", kv_cache_rotation="hadamard",
             kv_cache_dtype_skip_layers="1", kv_cache_plan="plan.json", disable_hybrid_kv_cache_manager=True,
             tensor_parallel_size=2,
             cpu_threads_per_rank=3, quantization="fp8", adaptive_cpu_threads=False, device="cpu",
             load_format="dummy", enforce_eager=True)


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _engine_dests(command: str) -> set[str]:
    return {a.dest for a in _subparser(command)._actions if a.dest in FIELDS}


def _flags(name: str, value: object) -> list[str]:
    if isinstance(value, bool):
        return [("--" if value else "--no-") + name.replace("_", "-")]
    return [EngineArgs.flag(name), str(value)]


def test_other_values_differ_from_defaults():
    assert set(OTHER) == set(FIELDS)
    assert all(OTHER[f.name] != f.default for f in fields(EngineArgs))


@pytest.mark.parametrize("command", sorted(OFFERED))
def test_every_engine_field_is_a_flag(command):
    """Every field is a flag of every subcommand that runs a model, except the documented exclusions."""
    assert _engine_dests(command) == OFFERED[command]


@pytest.mark.parametrize("command", sorted(OFFERED))
def test_from_cli_args_round_trips(command):
    parser = build_parser()
    defaults = EngineArgs.from_cli_args(parser.parse_args(BASE_ARGV[command]))
    tool_defaults = EVAL_DEFAULTS if command == "eval" else {}
    for f in fields(EngineArgs):
        if f.name != "model":
            assert getattr(defaults, f.name) == tool_defaults.get(f.name, f.default), f.name
    argv = list(BASE_ARGV[command])
    for name in sorted(OFFERED[command] - {"model"}):
        argv += _flags(name, OTHER[name])
    got = EngineArgs.from_cli_args(parser.parse_args(argv))
    for name in OFFERED[command] - {"model"}:
        assert getattr(got, name) == OTHER[name], name
    for name in set(FIELDS) - OFFERED[command]:
        assert getattr(got, name) == getattr(EngineArgs(), name), name


def test_model_argument_of_each_command():
    parser = build_parser()
    for argv in (["generate", "x", "--model", "A"], ["generate", "x", "-m", "A"], ["serve", "--model-id", "A"],
                 ["serve", "--model", "A"], ["run", "A"], ["info", "A"], ["calibrate", "A", "--data", "d"],
                 ["eval", "A", "--data", "d"]):
        assert EngineArgs.from_cli_args(parser.parse_args(argv)).model == "A", argv


def test_eval_configurations_have_one_flag_that_shadows_no_engine_option():
    ns = build_parser().parse_args(BASE_ARGV["eval"] + ["--config", "fp8", "--config", "--kv-cache-dtype bfloat16"])
    assert ns.kv_configs == ["fp8", "--kv-cache-dtype bfloat16"]
    assert EngineArgs.from_cli_args(ns).kv_cache_dtype == "auto"   # not an engine option of eval
    with pytest.raises(SystemExit):   # the engine flag is not offered: a configuration is --config
        build_parser().parse_args(BASE_ARGV["eval"] + ["--kv-cache-dtype", "fp8"])


CHOICE_FIELDS = {"dtype": DTYPE_CHOICES,
                 "attention_backend": ATTENTION_BACKENDS, "dense_backend": DENSE_BACKENDS,
                 "kv_cache_scale_mode": SCALE_MODES,
                 "quantization": QUANTIZATION_CHOICES, "device": DEVICE_CHOICES, "load_format": LOAD_FORMATS}


def test_choices_come_from_the_declaring_tuples():
    by_name = {f.name: f for f in fields(EngineArgs)}
    assert {n for n, f in by_name.items() if f.metadata["choices"]} == set(CHOICE_FIELDS)
    for name, choices in CHOICE_FIELDS.items():
        assert by_name[name].metadata["choices"] is choices


def test_attention_backends_match_the_registry():
    from kv8.attention.backend import BACKENDS

    assert set(ATTENTION_BACKENDS) == {"auto", *BACKENDS}


@pytest.mark.parametrize("command,name", [(c, n) for c in sorted(OFFERED) for n in sorted(CHOICE_FIELDS)
                                          if n in OFFERED[c]])
def test_bad_choice_is_an_argparse_error_naming_the_allowed_values(command, name, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(BASE_ARGV[command] + [EngineArgs.flag(name), "nonsense"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {EngineArgs.flag(name)}: invalid choice: 'nonsense'" in err
    assert all(c in err for c in CHOICE_FIELDS[name])


def test_bad_values_are_argparse_errors(capsys):
    parser = build_parser()
    for argv, message in ((["--kv-cache-memory", "lots"], "argument --kv-cache-memory: kv_cache_memory='lots' is "
                                                          "not a memory size"),
                          (["--block-size", "x"], "argument --block-size: invalid int value: 'x'"),
                          (["--gpu-memory-utilization", "most"], "argument --gpu-memory-utilization: invalid float "
                                                                 "value: 'most'"),
                          (["--dense-backend", "cpu"], "invalid choice: 'cpu' (choose from 'auto', 'torch', "
                                                       "'torch_fp32', 'packed_bf16')")):
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", "x", *argv])
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("bad,why", [("nonsense", "kv_cache_dtype='nonsense' is not supported"),
                                     ("int8/int2", "kv_cache_dtype='int8/int2', its V format: kv_cache_dtype='int2'"),
                                     ("auto/int4", "kv_cache_dtype='auto/int4': a K/V pair is written KFORMAT/VFORMAT"),
                                     ("int8/int4/fp8", "kv_cache_dtype='int8/int4/fp8': a K/V pair is written")])
def test_kv_cache_dtype_flag_checks_single_names_and_pairs(bad, why, capsys):
    """--kv-cache-dtype takes a name or a K/V pair; a bad one is an argparse error saying what is allowed."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--kv-cache-dtype", bad])
    err = capsys.readouterr().err
    assert f"argument --kv-cache-dtype: {why}" in err
    assert all(c in err for c in ("bfloat16", "fp8_e4m3", "int8_per_token_head", "int4_per_group32", "fp4_e2m1"))
    assert "int8/int4_g32" in err
    for good in ("fp8", "int8/int4_g32", "k8v4", "bf16/fp4"):
        assert build_parser().parse_args(["generate", "x", "--kv-cache-dtype", good]).kv_cache_dtype == good


@pytest.mark.parametrize("bad", ["nonsense", "hadamard/", "none/givens", "none/none/none"])
def test_kv_cache_rotation_flag_checks_single_names_and_pairs(bad, capsys):
    """--kv-cache-rotation takes a rotation or a K/V pair of them (kv8.quant.rotation.ROTATIONS); a bad one is an
    argparse error saying what is allowed; a good one arrives spelled canonically."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--kv-cache-rotation", bad])
    err = capsys.readouterr().err
    assert f"argument --kv-cache-rotation: kv_cache_rotation={bad!r} is not supported; choose none, hadamard, or " \
           "keys/values apart such as none/hadamard" in err
    assert all(r in err for r in ROTATIONS)
    for good, canonical in (("hadamard", "hadamard"), ("none/hadamard", "none/hadamard"),
                            ("hadamard/hadamard", "hadamard")):
        assert build_parser().parse_args(["generate", "x", "--kv-cache-rotation", good]).kv_cache_rotation == canonical


def test_cli_spellings():
    ns = build_parser().parse_args(["generate", "x", "--dtype", "BF16", "--kv-cache-memory", "1000000"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.dtype, args.kv_cache_memory) == ("bf16", "1000000")


def test_add_cli_args_rejects_mistakes():
    with pytest.raises(ValueError, match="not EngineArgs fields: nope"):
        EngineArgs.add_cli_args(argparse.ArgumentParser(), exclude=("nope",))
    with pytest.raises(ValueError, match="name fields this parser does not offer"):
        EngineArgs.add_cli_args(argparse.ArgumentParser(), exclude=("seed",), defaults={"seed": 1})
    with pytest.raises(ValueError, match="default attention_backend='fast' is not one of: auto, cpu_fused"):
        EngineArgs.add_cli_args(argparse.ArgumentParser(), defaults={"attention_backend": "fast"})


def test_describe_and_help_list_every_option(capsys):
    text = EngineArgs.describe()
    for f in fields(EngineArgs):
        assert f.name in text and f.metadata["help"] in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = capsys.readouterr().out
    assert all(EngineArgs.flag(n) in out for n in FIELDS if n != "model")
    assert "--no-enable-prefix-caching" in out


def test_llm_docstring_points_at_engine_args():
    from kv8.entrypoints.llm import LLM

    assert "EngineArgs.describe()" in (LLM.__doc__ or "")


# ---- validation happens in the config, with messages naming field, value and allowed values ----------------------
HF = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)


def _config(**kw):
    return EngineArgs(**kw).create_engine_config(HF, "hf", "/m")


def test_dense_backend_names():
    assert DENSE_BACKENDS == ("auto", "torch", "torch_fp32", "packed_bf16")
    with pytest.raises(ValueError, match="^dense_backend='x' is not supported; choose one of: auto, torch, "
                                         "torch_fp32, packed_bf16$"):
        _config(dense_backend="x")
    with pytest.raises(ValueError, match="dense_backend='packed_bf16' needs dtype bfloat16"):
        _config(dense_backend="packed_bf16", dtype="float32")
    with pytest.raises(ValueError, match="dense_backend='cpu' is not supported"):
        _config(dense_backend="cpu")
    with pytest.raises(ValueError, match="^dense_backend='packed_bf16' needs dtype bfloat16, got torch.float32"):
        _config(dense_backend="packed_bf16", dtype="float32")
    assert _config(dense_backend="packed_bf16").dense_backend == "packed_bf16"
    assert _config(dense_backend="torch_fp32").dense_backend == "torch_fp32"


@pytest.mark.parametrize("kw,message", [
    (dict(attention_backend="fast"), "attention_backend='fast' is not supported; choose one of: auto, cpu_fused, "
                                     "reference"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching='yes' must be True or False"),
    (dict(kv_cache_memory="lots"), "kv_cache_memory='lots' is not a memory size"),
    (dict(num_kv_blocks=0), "num_kv_blocks=0 must be an int >= 1"),
    (dict(gpu_memory_utilization=1.1), r"gpu_memory_utilization=1.1 must be a finite number in \(0, 1\]"),
    (dict(block_size=3), "block_size=3 must be a power of two"),
    (dict(max_model_len=65), r"max_model_len=65 exceeds the model's context \(max_position_embeddings=64\)"),
    (dict(seed="1"), "seed='1' must be an int"),
    (dict(kv_cache_scale_mode="per-token"), "kv_cache_scale_mode='per-token' is not supported; choose one of: "
                                            "static, dynamic"),
    (dict(kv_cache_rotation="random"), "kv_cache_rotation='random' is not supported; choose none, hadamard, or "
                                       r"keys/values apart such as none/hadamard \(each side one of: none, hadamard\)"),
    (dict(kv_cache_rotation="hadamard/"), "kv_cache_rotation='hadamard/' is not supported; choose none, hadamard"),
])
def test_config_errors_name_field_value_and_allowed(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(**kw)


def test_arch_dependent_checks():
    with pytest.raises(ValueError, match="kv_cache_rotation='hadamard' needs a power-of-two head_dim"):
        EngineArgs(kv_cache_rotation="hadamard").create_engine_config({**HF, "head_dim": 6}, "hf", "/m")
    # a sliding window no longer caps the context: windowed layers attend to their window at any length
    windowed = {**HF, "sliding_window": 32}
    assert EngineArgs().create_engine_config(windowed, "hf", "/m").scheduler.max_model_len == 64
    assert EngineArgs(max_model_len=48).create_engine_config(windowed, "hf", "/m").arch.layer_window(0) == 32
    assert _config().scheduler.max_model_len == 64


def test_info_checks_block_size(tiny_llama, capsys):
    from kv8.entrypoints.cli import main

    assert main(["info", tiny_llama, "--block-size", "0"]) == 2
    assert "block_size=0 must be a power of two" in capsys.readouterr().err
    assert main(["info", tiny_llama, "--gpu-memory-utilization", "2"]) == 2
    assert "gpu_memory_utilization=2.0 must be a finite number in (0, 1]" in capsys.readouterr().err


def test_every_option_is_declared_once() -> None:
    """An option that a config holds as given is taken from that config (its default, help and allowed values, by
    ``from_config``); no option's default is written in two places, no two configs declare one and no two argument
    groups offer one."""
    from kv8.cache.config import CacheConfig
    from kv8.distributed.config import ParallelConfig
    from kv8.engine.config import EngineConfig, SchedulerConfig
    from kv8.entrypoints.openai.cli_args import ServerArgs
    from kv8.entrypoints.openai.tool_calling import ToolOptions

    configs = {c.__name__: c for c in (CacheConfig, SchedulerConfig, ParallelConfig, EngineConfig, ToolOptions)}
    declared: dict[str, str] = {}
    for config in configs.values():
        for f in fields(config):
            if "help" in f.metadata:
                assert f.name not in declared, f"{f.name} is declared by {declared[f.name]} and {config.__name__}"
                declared[f.name] = config.__name__
    groups = (EngineArgs, ServerArgs)
    assert not set(EngineArgs.field_names()) & set(ServerArgs.field_names())
    sourced = 0
    for group in groups:
        for f in fields(group):
            if f.name in declared:
                source = f"{declared[f.name]}.{f.name}"
                assert f.metadata["source"] == source, f"{group.__name__}.{f.name} redeclares {source}"
                owner = configs[declared[f.name]]
                assert f.default == owner.__dataclass_fields__[f.name].default   # type: ignore[attr-defined]
                sourced += 1
            else:
                assert f.metadata["source"] is None
    assert sourced == len(declared)   # every config option is offered by one group


def test_server_args_are_the_flags_of_serve_and_run() -> None:
    """Every ServerArgs field is a flag of serve and run (vLLM's -dp / -dpb too), and the namespace reads back
    into the same value; other commands have none of them."""
    from kv8.entrypoints.openai.cli_args import ServerArgs

    names = set(ServerArgs.field_names())
    for command in ("serve", "run"):
        assert {a.dest for a in _subparser(command)._actions} >= names
    for command in ("generate", "info", "calibrate", "eval"):
        assert not {a.dest for a in _subparser(command)._actions} & names
    ns = build_parser().parse_args(["serve", "m", "-dp", "2", "-dpb", "ray", "--port", "0", "--api-key", "k",
                                    "--max-n", "3", "--no-enable-tokenizer-info-endpoint", "--tool-call-parser",
                                    "hermes", "--enable-auto-tool-choice"])
    args = ServerArgs.from_cli_args(ns)
    assert (args.data_parallel_size, args.data_parallel_backend, args.port, args.api_key, args.max_n) == \
        (2, "ray", 0, "k", 3)
    assert not args.enable_tokenizer_info_endpoint and args.tool_options.enable_auto_tool_choice
    assert ServerArgs.from_cli_args(build_parser().parse_args(["run", "m"])) == ServerArgs()


@pytest.mark.parametrize(("kw", "message"), [
    (dict(max_n=0), "--max-n=0 must be an int >= 1"),
    (dict(max_tokens_limit=0), "--max-tokens-limit=0 must be an int >= 1"),
    (dict(max_waiting_requests=-1), "--max-waiting-requests=-1 must be an int >= 0"),
    (dict(port=70000), "--port=70000 must be an int in [0, 65535]"),
    (dict(shutdown_timeout=0.0), "--shutdown-timeout=0.0 must be a finite number > 0"),
    (dict(request_body_timeout=float("nan")), "--request-body-timeout=nan must be a finite number > 0"),
    (dict(api_key=" "), "--api-key must not be empty"),
    (dict(log_level="loud"), "--log-level='loud' is not supported"),
    (dict(enable_auto_tool_choice=True), "--enable-auto-tool-choice requires --tool-call-parser"),
    (dict(data_parallel_size=2), "--data-parallel-size=2 needs --data-parallel-backend ray"),
    (dict(data_parallel_size=0, data_parallel_backend="ray"), "--data-parallel-size=0 must be an int >= 1"),
    (dict(data_parallel_backend="ray", allowed_origins=("*",)), "--allowed-origins is not supported"),
    (dict(data_parallel_backend="ray", request_header_timeout=5.0), "--request-header-timeout is not supported"),
])
def test_server_args_errors_name_the_flag(kw, message) -> None:
    from kv8.entrypoints.openai.cli_args import ServerArgs

    with pytest.raises(ValueError, match=re.escape(message)):
        ServerArgs(**kw)


def test_blank_api_key_variable_is_an_error(monkeypatch) -> None:
    from kv8.entrypoints.openai.cli_args import ServerArgs

    monkeypatch.setenv("KV8_API_KEY", "  ")
    with pytest.raises(ValueError, match="KV8_API_KEY must not be blank"):
        ServerArgs().resolved_api_key()
    monkeypatch.setenv("KV8_API_KEY", "secret")
    assert ServerArgs().resolved_api_key() == "secret" and ServerArgs(api_key="k").resolved_api_key() == "k"


def test_shared_checks_are_written_once() -> None:
    """The int / number checks that exclude bools live in kv8.validators; no module writes them out again."""
    import re
    from pathlib import Path

    pattern = re.compile(r"isinstance\([^)]*,\s*bool\)\s*or\s*not\s*isinstance")
    root = Path(__file__).parent.parent / "kv8"
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
