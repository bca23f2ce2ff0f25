"""Tiny random Hugging Face models (Llama, Qwen2 with bias, GQA, Qwen3, Phi-3, Gemma 3, sliding windows) with a
small BPE tokenizer, built with transformers configs and ``save_pretrained``: transformers is then the independent
oracle for logits. The session's models are the fixtures of tests/conftest.py (``tiny_models``, ``tiny_llama``,
``nan_llama``); a test that needs another size or config calls :func:`make_tiny_model` itself."""

from __future__ import annotations

import torch

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


#: the token whose embedding row the ``nan_llama`` fixture (tests/conftest.py) sets to NaN: every prompt holding it
#: has NaN logits
POISONED_TOKEN = 7


#: the three added tokens of :func:`make_calling_model`'s answer, a hermes tool call (joined: its whole text)
CALL_PIECES = ["<tool_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>"]


def make_calling_model(path: str) -> str:
    """Save into ``path`` a tiny Llama that answers every chat with one hermes call (:data:`CALL_PIECES`) and then
    EOS, by construction: the call's three pieces are added tokens, every layer's output projections are zero (so
    the logits depend on the current token alone), and the LM head maps the prompt's last token ("\\n", where the
    tool-capable template of tests/fixtures/tool_chat_template.jinja, which it gets, ends the generation prompt)
    -> ``<tool_call>`` -> the call -> ``</tool_call>`` -> EOS through one-hot embeddings. The real engine,
    detokenizer and tool parser run on its text; its context is 2048 tokens."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from tests.helpers.paths import FIXTURES

    tok = make_tiny_model(path, "llama", max_position_embeddings=2048)   # to learn its vocabulary size
    vocab = len(AutoTokenizer.from_pretrained(tok))
    make_tiny_model(path, "llama", max_position_embeddings=2048, vocab_size=vocab + len(CALL_PIECES))
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(CALL_PIECES)
    tok.chat_template = (FIXTURES / "tool_chat_template.jinja").read_text()
    tok.save_pretrained(path)
    chain = [tok.convert_tokens_to_ids("\u010a"), *tok.convert_tokens_to_ids(CALL_PIECES), tok.eos_token_id]
    assert max(chain) < vocab + len(CALL_PIECES) and len(set(chain)) == len(chain), chain
    weights_file = next(Path(path).glob("*.safetensors"))
    w = load_file(str(weights_file))
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name].zero_()
    embed, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    for k, (token, successor) in enumerate(zip(chain, chain[1:])):
        embed[token] = 0.0
        embed[token, k] = 1.0                # a direction of its own
        head[successor] = 0.0
        head[successor, k] = 1.0             # its logit: sqrt(hidden) ~ 9.8, far above the others' (~1)
    save_file(w, str(weights_file), metadata={"format": "pt"})
    return path
