"""Calibration text and transformers' K/V over it: what ``kv8 calibrate`` / ``kv8 eval`` tests check against.

:func:`write_calibration_text` writes the small random-word text the tools' tests calibrate on; :func:`hf_windows`
cuts it into token windows as :func:`kv8.tools.data.token_windows` does (no special tokens); :func:`hf_kv` is the
oracle for what a KV cache stores over them (transformers' post-RoPE K/V, float32), :func:`hf_scored_nll` for what
``kv8 eval`` scores.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

WORDS = ("the quick brown fox jumps over lazy dog London is capital of England Paris France Berlin Germany "
         "once upon a time there was little model that stored its cache in eight bits numbers 0 1 2 3 4 5").split()


def write_calibration_text(path: Path) -> str:
    """1,500 words drawn from :data:`WORDS` (seed 0) written to ``path``; returns the path as a string."""
    rng = random.Random(0)
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(1500)) + ".\n")
    return str(path)


def hf_windows(model_dir: str, data: str, length: int, count: int, skip: int = 0) -> list[list[int]]:
    """``count`` consecutive windows of ``length`` tokens of ``data`` after ``skip`` tokens, by the model's
    tokenizer without special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(Path(data).read_text(), add_special_tokens=False)["input_ids"]
    return [ids[skip + i * length: skip + (i + 1) * length] for i in range(count)]


def hf_kv(model_dir: str, windows: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) of all windows, each ``[tokens, H, D]`` float32, from transformers' cache (window after
    window: position 0 of window ``i`` is row ``i * len(window)``)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    per_layer: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    for w in windows:
        cache = DynamicCache()
        with torch.no_grad():
            model(torch.tensor([w]), past_key_values=cache, use_cache=True)
        for i, layer in enumerate(cache.layers):
            if len(per_layer) <= i:
                per_layer.append(([], []))
            per_layer[i][0].append(layer.keys[0].transpose(0, 1))
            per_layer[i][1].append(layer.values[0].transpose(0, 1))
    return [(torch.cat(k), torch.cat(v)) for k, v in per_layer]


def hf_scored_nll(model: str, data: str, window: int, n: int, skip: int = 0, bos: int | None = None) -> list[float]:
    """transformers' negative log-likelihood of the tokens ``kv8 eval`` scores: the second half of each of the
    ``n`` windows of ``window`` tokens after ``skip`` (with ``bos``, each window's first token replaced by it, as
    ``--add-bos`` does)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    nll = []
    for w in hf_windows(model, data, window, n, skip=skip):
        if bos is not None:
            w = [bos, *w[1:]]
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([w])).logits[0].double(), dim=-1)
        nll.extend(-float(logp[p, w[p + 1]]) for p in range(window // 2 - 1, window - 1))
    return nll
