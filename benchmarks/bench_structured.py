"""Per-token overhead of structured output (grammar masks) next to unconstrained decoding, in one run.

Two measurements:

1. **Mask cost per token** for each model's vocabulary: a matcher walks the tokens of a JSON document that
   matches the schema; each step times the llguidance mask computation (``fill``) and its application to a
   row of logits (``apply``, :func:`kv8.engine.structured.apply_grammar_masks`). With ``--xgrammar`` (when it is
   installed) the same walk with xgrammar's matcher, for comparison.
2. **Decode, side by side**: the same batch of prompts, greedy, ``--tokens`` new tokens each, unconstrained and
   with a JSON schema; milliseconds per generated token (wall time / tokens) of each, and the difference.

Usage::

    python benchmarks/bench_structured.py                       # smollm2-135m, gemma3-270m mask costs
    python benchmarks/bench_structured.py --models smollm2-135m --batch 4 --tokens 48 --xgrammar
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from kv8 import LLM, SamplingParams, StructuredOutputsParams
from kv8.engine.structured import GrammarCompiler, apply_grammar_masks
from kv8.loader.sources import resolve_model_path
from kv8.loader.tokenizer import load_tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False,
}
DOC = json.dumps({"name": "Ada Lovelace, the first programmer", "age": 36,
                  "tags": ["math", "engines", "poetry", "notes"], "ok": True}, separators=(",", ":"))


def mask_cost(model: str, xgrammar: bool) -> None:
    kind, path = resolve_model_path(model)
    tok = load_tokenizer(kind, path)
    vocab = len(tok)
    ids = tok.encode(DOC, add_special_tokens=False)
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    matcher = compiler.matcher(StructuredOutputsParams(json=SCHEMA))
    setup = time.perf_counter() - t0
    logits = torch.randn(1, vocab)
    fill = total = 0.0
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        fill += time.perf_counter() - t0
        x = logits.clone()
        t0 = time.perf_counter()
        apply_grammar_masks(x, [matcher])          # fills again, then applies
        total += time.perf_counter() - t0
        assert matcher.accept(t), matcher.error
    n = len(ids)
    print(f"{model:14s} vocab {vocab:6d}  llguidance: first request {setup * 1e3:7.0f} ms, fill {fill / n * 1e6:5.0f} "
          f"us/token, fill+apply {total / n * 1e6:5.0f} us/token ({n} tokens)")
    if xgrammar:
        import xgrammar as xgr

        t0 = time.perf_counter()
        compiler_x = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), max_threads=1)
        compiled = compiler_x.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
        xm = xgr.GrammarMatcher(compiled)
        setup = time.perf_counter() - t0
        fill = 0.0
        for t in ids:
            t0 = time.perf_counter()
            xm.fill_next_token_bitmask(bitmask, 0)
            fill += time.perf_counter() - t0
            assert xm.accept_token(t)
        print(f"{'':14s} {'':12s}  xgrammar:   first request {setup * 1e3:7.0f} ms, "
              f"fill {fill / n * 1e6:5.0f} us/token")


def decode(model: str, batch: int, tokens: int) -> None:
    llm = LLM(model)
    prompts = [f"Describe person number {i} as JSON." for i in range(batch)]
    spec = StructuredOutputsParams(json=SCHEMA)
    rows = {}
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=spec), use_tqdm=False)
    for name, structured in (("unconstrained", None), ("json_schema", spec)):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=structured is None,
                                structured_outputs=structured)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        n = sum(len(c.token_ids) for o in outs for c in o.outputs)
        rows[name] = wall / n * 1e3
        print(f"{model:14s} batch {batch}  {name:13s} {n:5d} tokens  {rows[name]:7.2f} ms/token")
    diff = rows["json_schema"] - rows["unconstrained"]
    print(f"{model:14s} batch {batch}  overhead      {diff:+7.2f} ms/token ({diff / rows['unconstrained']:+.1%})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--decode-models", nargs="*", default=["smollm2-135m"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--xgrammar", action="store_true", help="also time xgrammar's masks (if installed)")
    args = ap.parse_args()
    for m in args.models:
        mask_cost(m, args.xgrammar)
    for m in args.decode_models:
        decode(m, args.batch, args.tokens)


if __name__ == "__main__":
    main()
