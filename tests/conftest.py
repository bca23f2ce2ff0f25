"""Shared fixtures: tiny random Hugging Face models (Llama, Qwen2 with bias, GQA, Qwen3, Phi-3, Gemma 3, sliding
windows) with a small BPE tokenizer.

Models are built with transformers configs and ``save_pretrained`` into a session temp dir; transformers is
then the independent oracle for logits.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# dense_backend=auto by the fixed rule: the tests' engines do not time candidates (tests/layers/test_tuning.py
# turns tuning on where it tests it), so what a test runs does not depend on the machine's timings
os.environ.setdefault("KV8_TUNING", "off")
if not torch.cuda.is_available():
    # kv8's Triton kernels (the GPU path) run in Triton's interpreter on CPU tensors; the variable is read when a
    # kernel is decorated, so it is set before any test module imports one (tests/helpers/triton.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TEXT = [
    "The quick brown fox jumps over the lazy dog. London is the capital of England.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Once upon a time there was a little model that stored its cache in eight bits.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { }",
] * 4

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")

TINY_CONFIGS = {
    # name: (model_type, extra config)
    "llama": ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama_gqa": ("llama", dict(num_attention_heads=6, num_key_value_heads=2)),
    "qwen2": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    # sliding windows smaller than the test prompts: every layer (Mistral), or layer 1 only (Qwen2's
    # max_window_layers: layers from that index on are sliding)
    "mistral_swa": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=11)),
    "qwen2_swa": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                sliding_window=7, max_window_layers=1)),
    # fused qkv_proj / gate_up_proj in the checkpoint; hidden_size / heads = head_dim, as transformers' Phi-3 needs
    "phi3": ("phi3", dict(num_attention_heads=6, num_key_value_heads=2, sliding_window=None, pad_token_id=0)),
    # MQA, head_dim 32, local layers 0, 1, 3 (window 16, base 10k) and a global layer 2 (base 1M, linear x2),
    # query_pre_attn_scalar unlike head_dim, tied embeddings
    "gemma3": ("gemma3_text", dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                   sliding_window=16, layer_types=["sliding_attention", "sliding_attention",
                                                                   "full_attention", "sliding_attention"],
                                   rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0}, query_pre_attn_scalar=24,
                                   tie_word_embeddings=True)),
}


def _make_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_tiny_model(path: str, name: str, seed: int = 0, **overrides) -> str:
    """Save a tiny random model of kind ``name`` (see TINY_CONFIGS) with a tokenizer into ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = TINY_CONFIGS[name]
    tok = _make_tokenizer(path)
    cfg = dict(vocab_size=len(tok), hidden_size=96, intermediate_size=192, num_hidden_layers=2,
               head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    cfg.update(extra)
    cfg.update(overrides)
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than default init so that attention is not uniform
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif model_type == "gemma3_text" and pname.endswith("norm.weight"):   # (1 + w) norms: w near 0
                p.uniform_(-0.5, 0.5)
            elif pname.endswith(("q_norm.weight", "k_norm.weight")):   # QK-norm weights other than 1
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name in TINY_CONFIGS:
        out[name] = make_tiny_model(str(tmp_path_factory.mktemp(name)), name)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(autouse=True)
def _engines_keep_their_threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built in a test keep their thread count: the governor (:mod:`kv8.engine.threads`) would follow
    whatever else runs on the test machine, and with the torch dense backend (float32 models) a thread count
    changes the last bits of some matmuls, so two runs a test compares bit for bit could differ. Tests marked
    ``adaptive_threads`` (the governor's own) run it as it is."""
    if request.node.get_closest_marker("adaptive_threads") is None:
        from kv8.engine.threads import ThreadGovernor

        monkeypatch.setattr(ThreadGovernor, "target", lambda self, others: self.threads)


#: the token whose embedding row :func:`nan_llama` sets to NaN: every prompt holding it has NaN logits
POISONED_TOKEN = 7


@pytest.fixture(scope="session")
def nan_llama(tiny_llama, tmp_path_factory) -> str:
    """The tiny Llama with a NaN in the embedding of :data:`POISONED_TOKEN`: a request whose prompt holds that
    token gets NaN logits (a broken checkpoint as users meet it), the others are unaffected."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path_factory.mktemp("nan_llama") / "model"
    shutil.copytree(tiny_llama, bad)
    weights_file = next(bad.glob("*.safetensors"))
    weights = load_file(str(weights_file))
    weights["model.embed_tokens.weight"][POISONED_TOKEN] = float("nan")
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    return str(bad)


@contextlib.contextmanager
def amx_path(lib: Any, path: str) -> Iterator[str]:
    """Runs the body with a kernel library's ``amx`` flag set for ``path`` ("amx": AMX tiles; any other name: the
    AVX-512 path), restored afterwards; an "amx" path is skipped where the library has no AMX tiles (this CPU,
    build or OS). For the fixtures that run a test on each of a library's two paths."""
    if path == "amx" and not lib.amx:
        pytest.skip("this CPU, build or OS gives no AMX-BF16 tiles")
    chosen = lib.amx
    lib.amx = path == "amx"
    try:
        yield path
    finally:
        lib.amx = chosen
