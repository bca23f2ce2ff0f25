"""Structured output (grammar-constrained decoding), offline and through the official openai client.

Oracles: the JSON schema itself (outputs are parsed and their structure checked by hand: jsonschema is not a
dependency), the same requests without a grammar (a batch that mixes constrained and unconstrained requests
leaves the unconstrained ones bit-identical), and the server against itself (streamed vs. not streamed).
The tiny random model would never produce JSON on its own, so any valid output comes from the grammar.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from kv8 import LLM, SamplingParams, StructuredOutputsParams
from kv8.engine.structured import apply_grammar_masks, check_grammar, unpack_bitmask
from tests.helpers.server import API_KEY, ENGINE_FLAGS, SERVER_FLAGS, Server

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["color", "ok", "n", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["The quick brown fox", "Paris is the capital of", "Once upon a time"]


def check_schema(text: str) -> dict[str, Any]:
    """``text`` parses as JSON and matches :data:`SCHEMA` (checked by hand)."""
    obj = json.loads(text)
    assert isinstance(obj, dict) and set(obj) == {"color", "ok", "n", "tags"}, obj
    assert obj["color"] in ("red", "green", "blue") and isinstance(obj["ok"], bool), obj
    assert isinstance(obj["n"], int) and not isinstance(obj["n"], bool) and 0 <= obj["n"] <= 99, obj
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and set(obj["tags"]) <= {"a", "b"}, obj
    return obj


def _llm(path: str, **kw: Any) -> LLM:
    return LLM(path, dtype="float32", num_kv_blocks=kw.pop("num_kv_blocks", 128), block_size=16, max_model_len=256,
               max_num_seqs=8, **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return _llm(tiny_llama)


# ---- parameters and grammars ------------------------------------------------------------------------------
def test_structured_outputs_params_validation() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a+")
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": SCHEMA})  # type: ignore[arg-type]
    # a dict and its JSON string are the same grammar (hashable: compiled grammars are cached by it)
    assert StructuredOutputsParams(json=SCHEMA) == StructuredOutputsParams(json=json.dumps(SCHEMA))
    assert hash(StructuredOutputsParams(choice=["a", "b"])) == hash(StructuredOutputsParams(choice=("a", "b")))
    for bad in (StructuredOutputsParams(json={"type": "foo"}), StructuredOutputsParams(regex="[a-"),
                StructuredOutputsParams(json={"$ref": "#/nope"}), StructuredOutputsParams(grammar="start: nope")):
        with pytest.raises(ValueError, match="structured_outputs"):
            check_grammar(bad)


def test_mask_touches_only_rows_with_a_grammar() -> None:
    """Rows without a matcher are bit-identical; a masked row keeps exactly the allowed tokens."""

    class Only:   # a matcher that allows tokens 3 and 40
        def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
            bitmask[row, 0] = 1 << 3
            bitmask[row, 1] = 1 << (40 - 32)

    logits = torch.randn(3, 70)
    before = logits.clone()
    apply_grammar_masks(logits, [None, Only(), None])  # type: ignore[list-item]
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3, 40]
    assert torch.equal(logits[1, [3, 40]], before[1, [3, 40]])
    packed = torch.tensor([[-1, 1]], dtype=torch.int32)   # bit 31 of word 0 is the sign bit
    assert unpack_bitmask(packed, 40).nonzero()[:, 1].tolist() == list(range(32)) + [32]


# ---- offline ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_json_schema_offline_every_kv_dtype(tiny_llama: str, kv_cache_dtype: str) -> None:
    """n > 1, seeded random sampling, several prompts: every output is complete JSON matching the schema."""
    llm = _llm(tiny_llama, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=96,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            check_schema(c.text)
    again = llm.generate(PROMPTS, params, use_tqdm=False)   # seeds reproduce
    assert [[c.text for c in o.outputs] for o in again] == [[c.text for c in o.outputs] for o in outs]


def test_other_grammars_offline(llm: LLM) -> None:
    def texts(spec: StructuredOutputsParams, **kw: Any) -> list[str]:
        p = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=64, structured_outputs=spec, **kw)
        return [c.text for o in llm.generate(PROMPTS, p, use_tqdm=False) for c in o.outputs]

    assert set(texts(StructuredOutputsParams(choice=["yes", "no", "maybe \"so\""]))) <= {"yes", "no", 'maybe "so"'}
    pattern = r"[0-9]{3}-[a-z]{2}"
    assert all(re.fullmatch(pattern, t) for t in texts(StructuredOutputsParams(regex=pattern)))
    assert all(t in ("ab", "abab") for t in texts(StructuredOutputsParams(grammar='start: "ab" | "abab"')))
    # json_object: a JSON object whenever the grammar got to finish (a random model may write long strings)
    for out in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=64,
                                                    structured_outputs=StructuredOutputsParams(json_object=True)),
                            use_tqdm=False):
        c = out.outputs[0]
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "foo"})),
                     use_tqdm=False)


def test_unconstrained_requests_unchanged_in_a_mixed_batch(llm: LLM) -> None:
    """Greedy and seeded requests give the same tokens alone and batched with constrained requests."""
    plain = [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=0.9, seed=11, max_tokens=24)]
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    spec = StructuredOutputsParams(json=SCHEMA)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS, plain + [SamplingParams(temperature=0.9, seed=5, max_tokens=96,
                                                                        structured_outputs=spec)] * 3,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[2:]:
        check_schema(o.outputs[0].text)


def test_structured_output_survives_preemption(tiny_llama: str) -> None:
    """A pool too small for every request at once preempts some: their matchers stay with their kept tokens."""
    llm = _llm(tiny_llama, num_kv_blocks=17)
    spec = StructuredOutputsParams(json=SCHEMA)
    long_prompt = " ".join(PROMPTS * 6)
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=96, structured_outputs=spec)
    outs = llm.generate([long_prompt, long_prompt + " again"], params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    for o in outs:
        for c in o.outputs:
            check_schema(c.text)


# ---- server (official openai client) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    srv = Server(["serve", "--model-id", tiny_llama, "--api-key", API_KEY, "--kv-cache-dtype", "fp8",
                  *ENGINE_FLAGS, *SERVER_FLAGS], log, env={"OMP_NUM_THREADS": "1"})
    yield srv
    assert srv.stop() == 0, srv.read_log()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60.0)


RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a thing as JSON."}]


def test_chat_json_schema_n_streaming(client: openai.OpenAI, tiny_llama: str) -> None:
    resp = client.chat.completions.create(model=tiny_llama, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                          n=3, temperature=1.0, seed=4, max_tokens=96)
    assert len(resp.choices) == 3
    texts = [c.message.content or "" for c in sorted(resp.choices, key=lambda c: c.index)]
    for c in resp.choices:
        assert c.finish_reason == "stop"
    for t in texts:
        check_schema(t)
    stream = client.chat.completions.create(model=tiny_llama, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                            n=3, temperature=1.0, seed=4, max_tokens=96, stream=True)
    streamed = ["", "", ""]
    for chunk in stream:
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == texts


def test_completions_json_object_and_schema(client: openai.OpenAI, tiny_llama: str) -> None:
    resp = client.completions.create(model=tiny_llama, prompt=PROMPTS, max_tokens=96, temperature=0.0,
                                     extra_body={"response_format": RESPONSE_FORMAT})
    for c in resp.choices:
        check_schema(c.text)
    resp = client.completions.create(model=tiny_llama, prompt="Hi", max_tokens=48, temperature=0.0,
                                     extra_body={"response_format": {"type": "json_object"}})
    text = resp.choices[0].text
    assert text.startswith("{")
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_chat_parse_with_a_pydantic_model(client: openai.OpenAI, tiny_llama: str) -> None:
    """The openai SDK's ``parse`` (what LangChain's ``with_structured_output`` and LiteLLM send: a strict
    json_schema built from a pydantic model) gets a parsed object back."""
    from typing import Literal

    from pydantic import BaseModel

    class Thing(BaseModel):
        color: Literal["red", "green", "blue"]
        ok: bool

    resp = client.chat.completions.parse(model=tiny_llama, messages=MESSAGES, response_format=Thing,
                                         temperature=0.0, max_tokens=48)
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, Thing)


def test_bad_schema_is_a_400_naming_response_format(client: openai.OpenAI, tiny_llama: str) -> None:
    bad = [{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
           {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
           {"type": "json_schema", "json_schema": {"name": "x"}},
           {"type": "xml"}]
    for fmt in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=tiny_llama, messages=MESSAGES, response_format=fmt,  # type: ignore
                                           max_tokens=8)
        assert e.value.body["param"] == "response_format", (fmt, e.value.body)  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=tiny_llama, prompt="Hi", max_tokens=8,
                                  extra_body={"response_format": bad[0]})
    assert e.value.body["param"] == "response_format"  # type: ignore[index]


def test_grammar_complete_before_min_tokens_fails_the_request_saying_so(llm: LLM) -> None:
    """A grammar that is complete (only end of sequence may follow) while min_tokens forbids stopping leaves no
    token: the request fails alone with that reason, not as broken logits; ignore_eos is refused up front."""
    spec = StructuredOutputsParams(choice=["yes"])
    params = [SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6, structured_outputs=spec),
              SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=spec)]
    outs = llm.generate(["a", "b"], params, use_tqdm=False)
    failed, fine = outs[0].outputs[0], outs[1].outputs[0]
    assert failed.finish_reason == "error" and "matches the whole grammar" in (failed.error or "")
    assert "min_tokens=6" in (failed.error or "") and "non-finite" not in (failed.error or "")
    assert fine.text == "yes" and fine.finish_reason == "stop"
    with pytest.raises(ValueError, match="ignore_eos=True cannot be combined with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs=spec)
