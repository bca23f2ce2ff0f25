"""Per-request sampling parameters, named and defaulted like vLLM's ``SamplingParams``.

User code written for vLLM ports unchanged for the fields listed below: the names, defaults and
meanings match vLLM's. Everything is validated once, in ``__post_init__``; a bad value raises
``ValueError`` naming the field, the value and what is allowed. Types are checked too: ``bool`` is
not accepted where a number is expected, and NaN / infinity are rejected.

Invariants after construction:

* ``stop`` is a ``list[str]`` of non-empty strings (``None`` and a single string are normalised).
* ``stop_token_ids`` is a ``list[int]`` of non-negative ids (``None`` is normalised to ``[]``).
* ``logit_bias`` is ``None`` or a new ``dict[int, float]`` (non-negative ids, biases in [-100, 100]); an empty
  dict is normalised to ``None``.
* float fields hold ``float`` values, int fields hold ``int`` values.

The dataclass is frozen so that the engine can share one validated object between the ``n`` samples
of a request without copying; use ``dataclasses.replace`` to derive a modified copy (it re-validates).
The normalisation above is the only place that writes fields after ``__init__``, and it happens
before the object is handed out.

Greedy vs random: a temperature below ``GREEDY_TEMPERATURE_EPS`` (1e-5, as in vLLM) means greedy
decoding; ``top_k``, ``top_p``, ``min_p`` and ``seed`` are then irrelevant. ``n > 1`` with greedy
decoding is allowed (vLLM allows it) but the ``n`` samples will be identical.

Penalties and logit bias (vLLM's semantics) change the logits before greedy or random selection, for greedy
rows too: ``logit_bias`` is added first, then ``repetition_penalty`` (over prompt and output tokens) divides
positive logits and multiplies negative ones, then ``frequency_penalty`` times each output token's count and
``presence_penalty`` for each token present in the output are subtracted. At their defaults (0, 0, 1, None)
the logits are untouched. Logprobs stay those of the raw logits.

Structured output (vLLM's offline API): ``structured_outputs=StructuredOutputsParams(json=schema)`` (or
``json_object=True``, ``regex=``, ``choice=``, ``grammar=`` a Lark grammar) restricts every generated token to
those the grammar allows, and EOS to where the grammar accepts (see :mod:`kv8.engine.structured`). The grammar
is compiled where the request enters the engine; an unusable one is a ``ValueError`` naming
``structured_outputs``.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any

from kv8.validators import is_int, is_number

__all__ = ["GREEDY_TEMPERATURE_EPS", "SamplingParams", "SamplingType", "StructuredOutputsParams"]

GREEDY_TEMPERATURE_EPS = 1e-5
"""Temperatures strictly below this value select greedy decoding (same threshold as vLLM)."""

# torch.Generator.manual_seed accepts exactly this inclusive range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


class SamplingType(enum.Enum):
    """How the next token of a request is chosen."""

    GREEDY = "greedy"
    RANDOM = "random"


def _check_int(name: str, value: Any, lo: int | None, hi: int | None, allowed: str) -> int:
    if not is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return int(value)


def _check_optional_int(name: str, value: Any, lo: int, allowed: str) -> int | None:
    if value is None:
        return None
    return _check_int(name, value, lo, None, allowed + " or None")


def _check_float(name: str, value: Any, ok: Any, allowed: str) -> float:
    """Return ``float(value)`` if it is a finite real (not bool) and ``ok(float(value))``."""
    if not is_number(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    as_float = float(value)
    if not math.isfinite(as_float) or not ok(as_float):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return as_float


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def _normalise_stop(value: Any) -> list[str]:
    allowed = "None, a non-empty string or a list of non-empty strings"
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be {allowed}, got {value!r}")
    for item in items:
        if not isinstance(item, str) or item == "":
            raise ValueError(f"stop must be {allowed}, got {value!r} (bad entry {item!r})")
    return list(items)


_LOGIT_BIAS_LIMIT = 100.0


def _normalise_logit_bias(value: Any) -> dict[int, float] | None:
    lim = _LOGIT_BIAS_LIMIT
    allowed = f"None or a dict of token id (int >= 0) -> bias (a number in [-{lim:g}, {lim:g}])"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be {allowed}, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not is_int(key) or key < 0:
            raise ValueError(f"logit_bias must be {allowed}, got {value!r} (bad token id {key!r})")
        if not is_number(bias) or not math.isfinite(float(bias)) or abs(float(bias)) > _LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias must be {allowed}, got {value!r} (bad bias {bias!r} for token {key!r})")
        out[int(key)] = float(bias)
    return out or None


def _normalise_stop_token_ids(value: Any) -> list[int]:
    allowed = "None or a list of token ids (ints >= 0)"
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop_token_ids must be {allowed}, got {value!r}")
    for item in value:
        if not is_int(item) or item < 0:
            raise ValueError(f"stop_token_ids must be {allowed}, got {value!r} (bad entry {item!r})")
    return [int(item) for item in value]


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match: exactly one of the fields below (vLLM's ``StructuredOutputsParams``).

    Fields:
        json: a JSON schema, as a dict or a JSON string (normalised to a string).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings (normalised to a tuple).
        grammar: a Lark grammar (llguidance's dialect, ``start`` is the root rule).
        json_object: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).

    Frozen and hashable, so compiled grammars can be cached by it.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is not False:
            _check_bool("structured_outputs.json_object", self.json_object)
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or a JSON string), "
                                     f"got invalid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {schema!r:.80}")
            object.__setattr__(self, "json", json.dumps(schema))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r:.80}")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """The field that is set (for messages)."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (see the module docstring for invariants).

    Fields:
        n: number of samples to generate for the prompt, >= 1 (identical samples when greedy).
        temperature: >= 0; below 1e-5 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens, >= 1; 0 or -1 disables (vLLM accepts both).
        min_p: in [0, 1]; drop tokens whose probability is below ``min_p`` times the top probability.
        seed: per-request random seed (any int torch.Generator.manual_seed accepts), or None to draw
            one from the engine's generator.
        max_tokens: maximum number of generated tokens, >= 1, or None for up to the model's context.
        min_tokens: EOS and stop tokens are not allowed before this many tokens, 0 <= min_tokens <=
            max_tokens.
        stop: strings that end generation when produced (normalised to ``list[str]``).
        stop_token_ids: token ids that end generation (normalised to ``list[int]``).
        ignore_eos: keep generating after the EOS token.
        include_stop_str_in_output: keep the matched stop string in the returned text.
        logprobs: number of top logprobs returned per generated token, >= 0 (0 = only the sampled
            token's logprob), or None for no logprobs.
        prompt_logprobs: the same for prompt tokens.
        skip_special_tokens: drop special tokens when detokenizing.
        presence_penalty: in [-2, 2]; subtracted from the logit of every token already in the output (> 0
            favours new tokens).
        frequency_penalty: in [-2, 2]; times the number of times a token is in the output, subtracted from
            its logit.
        repetition_penalty: > 0 (1 disables); tokens in the prompt or the output have positive logits
            divided by it and negative logits multiplied by it.
        logit_bias: token id -> bias in [-100, 100] added to that token's logit (ids must be in the
            vocabulary; checked where the request enters the engine).
        structured_outputs: a :class:`StructuredOutputsParams` the output must match, or None.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        values: dict[str, Any] = {
            "n": _check_int("n", self.n, 1, None, "an int >= 1"),
            "temperature": _check_float(
                "temperature", self.temperature, lambda v: v >= 0.0, "a finite number >= 0"
            ),
            "top_p": _check_float(
                "top_p", self.top_p, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"
            ),
            "top_k": self._checked_top_k(),
            "min_p": _check_float(
                "min_p", self.min_p, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"
            ),
            "seed": None
            if self.seed is None
            else _check_int("seed", self.seed, _SEED_MIN, _SEED_MAX,
                            f"None or an int in [{_SEED_MIN}, {_SEED_MAX}]"),
            "max_tokens": _check_optional_int("max_tokens", self.max_tokens, 1, "an int >= 1"),
            "min_tokens": _check_int("min_tokens", self.min_tokens, 0, None, "an int >= 0"),
            "stop": _normalise_stop(self.stop),
            "stop_token_ids": _normalise_stop_token_ids(self.stop_token_ids),
            "ignore_eos": _check_bool("ignore_eos", self.ignore_eos),
            "include_stop_str_in_output": _check_bool(
                "include_stop_str_in_output", self.include_stop_str_in_output
            ),
            "logprobs": _check_optional_int("logprobs", self.logprobs, 0, "an int >= 0"),
            "prompt_logprobs": _check_optional_int(
                "prompt_logprobs", self.prompt_logprobs, 0, "an int >= 0"
            ),
            "skip_special_tokens": _check_bool("skip_special_tokens", self.skip_special_tokens),
            "presence_penalty": _check_float(
                "presence_penalty", self.presence_penalty, lambda v: -2.0 <= v <= 2.0, "a number in [-2, 2]"
            ),
            "frequency_penalty": _check_float(
                "frequency_penalty", self.frequency_penalty, lambda v: -2.0 <= v <= 2.0, "a number in [-2, 2]"
            ),
            "repetition_penalty": _check_float(
                "repetition_penalty", self.repetition_penalty, lambda v: v > 0.0, "a finite number > 0"
            ),
            "logit_bias": _normalise_logit_bias(self.logit_bias),
        }
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be None or a StructuredOutputsParams, "
                             f"got {self.structured_outputs!r:.80}")
        if self.structured_outputs is not None and values["ignore_eos"]:
            raise ValueError("ignore_eos=True cannot be combined with structured_outputs: a complete match of the "
                             "grammar allows only end of sequence, so there is nothing to generate after it")
        max_tokens = values["max_tokens"]
        if max_tokens is not None and values["min_tokens"] > max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({max_tokens}), got {self.min_tokens!r}"
            )
        # Normalisation during construction only (see module docstring).
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def _checked_top_k(self) -> int:
        top_k = self.top_k
        if not is_int(top_k) or not (top_k in (0, -1) or top_k >= 1):
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 to disable, got {top_k!r}")
        return int(top_k)

    @property
    def uses_penalties(self) -> bool:
        """True when presence, frequency or repetition penalty is on: the sampler then needs the request's
        prompt and output token ids."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY when ``temperature < GREEDY_TEMPERATURE_EPS``, else RANDOM."""
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM
