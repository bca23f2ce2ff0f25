"""From requests that advanced to the :class:`RequestOutput`s users see: text, stop strings, logprob dicts.

The scheduler appends tokens and applies the token-level stop rules; this module does everything that needs
the tokenizer, once per new token:

* incremental detokenization (:class:`IncrementalDetokenizer`); when a request finishes, text held back for
  an incomplete character is flushed (except after a stop string, where the text ends at the stop). The token
  that stops a request (EOS or one of ``stop_token_ids``) stays in ``token_ids`` but adds no text, unless
  ``include_stop_str_in_output`` (vLLM's rule: with ``skip_special_tokens=False`` an EOS would otherwise
  write ``<|im_end|>`` into the answer);
* stop strings: searched in the new text once the request has ``min_tokens`` outputs and did not stop on a
  token; a hit cuts the text (keeping the stop string if ``include_stop_str_in_output``), sets
  ``stop_reason`` and is reported back so that the engine finishes the request with ``stop`` (this also turns
  a ``length`` finish in the same step into ``stop``);
* logprob dicts (:class:`Logprob` with the decoded token), converted once per position and cached;
* grouping: the ``n`` requests of one user request become the ``outputs`` of one :class:`RequestOutput`,
  which is ``finished`` when all of them are; a finished group is forgotten.

Thread safety: the tokenizer is used only by the thread that drives the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from kv8.engine.detokenizer import IncrementalDetokenizer, backend_decode, find_stop
from kv8.engine.request import Request, RequestStatus, TokenLogprobs
from kv8.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


@dataclass
class _TextState:
    """Output-side state of one request: its text and its logprobs converted so far."""

    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)


@dataclass
class _Group:
    """One user request: its prompt and its ``n`` requests (``children[i].index == i``)."""

    request_id: str
    prompt: str | None
    children: list[Request]
    states: list[_TextState]


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode = backend_decode(tokenizer)
        self.groups: dict[str, _Group] = {}

    def add_request(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        states = [_TextState(IncrementalDetokenizer(self.tokenizer, c.sampling_params.skip_special_tokens,
                                                    self._decode))
                  for c in children]
        self.groups[request_id] = _Group(request_id, prompt, children, states)

    def abort_request(self, request_id: str) -> list[Request] | None:
        """Forget a user request; returns its requests (for the scheduler to finish), None if unknown."""
        group = self.groups.pop(request_id, None)
        return None if group is None else group.children

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def _state(self, req: Request) -> _TextState:
        return self.groups[req.parent_id or req.request_id].states[req.index]

    # ---- text -----------------------------------------------------------------------------------------------
    def detokenize(self, updated: list[Request]) -> list[Request]:
        """Add the text of each request's newest token; return the requests a stop string ends now.

        Invariant: each request in ``updated`` gained exactly one output token since the last call, except a
        failed one (status ``FINISHED_ERROR``), which gained none and keeps its text.
        """
        stopped = []
        for req in updated:
            if req.status is RequestStatus.FINISHED_ERROR:
                continue
            state = self._state(req)
            p = req.sampling_params
            if req.status is RequestStatus.FINISHED_STOPPED and not p.include_stop_str_in_output:
                # stopped on a token (EOS or stop_token_ids; a stop string is found below, never here): its text
                # is not part of the output, whether it is special or not (vLLM's rule)
                state.text += state.detokenizer.flush()
                continue
            delta = state.detokenizer.add(req.output_token_ids[-1])
            state.text += delta
            if (p.stop and delta and req.status != RequestStatus.FINISHED_STOPPED
                    and req.num_output_tokens >= p.min_tokens):
                hit = find_stop(state.text, len(delta), [p.stop] if isinstance(p.stop, str) else p.stop)
                if hit is not None:
                    idx, stop = hit
                    state.text = state.text[:idx + len(stop)] if p.include_stop_str_in_output else state.text[:idx]
                    req.stop_reason = stop
                    stopped.append(req)
                    continue
            if req.is_finished:
                state.text += state.detokenizer.flush()
        return stopped

    # ---- outputs --------------------------------------------------------------------------------------------
    def make_outputs(self, updated: list[Request]) -> list[RequestOutput]:
        """One cumulative :class:`RequestOutput` per user request that changed, in order of first change."""
        touched: dict[str, _Group] = {}
        for req in updated:
            rid = req.parent_id or req.request_id
            touched.setdefault(rid, self.groups[rid])
        outputs = [self._make_output(g) for g in touched.values()]
        for out in outputs:
            if out.finished:
                del self.groups[out.request_id]
        return outputs

    def _make_output(self, group: _Group) -> RequestOutput:
        outs = []
        for req, state in zip(group.children, group.states):
            want = req.sampling_params.logprobs is not None
            outs.append(CompletionOutput(
                index=req.index, text=state.text, token_ids=list(req.output_token_ids),
                cumulative_logprob=req.cumulative_logprob if want else None,
                logprobs=(cast("list[PositionLogprobs]", self._converted(req.logprobs, state.logprobs)) if want
                          else None),
                finish_reason=req.status.value if req.is_finished else None, stop_reason=req.stop_reason,
                error=req.error))
        first = group.children[0]
        prompt_lps = None
        if first.wants_prompt_logprobs:
            # An output exists only once the whole prompt is computed; the first prompt token has no logprob,
            # so a one-token prompt has [None] (as vLLM returns), never [].
            prompt_lps = self._converted(first.prompt_logprobs or [None], group.states[0].prompt_logprobs)
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=prompt_lps, outputs=outs, finished=all(r.is_finished for r in group.children),
            num_cached_tokens=first.num_cached_prompt_tokens)

    def _converted(self, raw: Sequence[TokenLogprobs | None], done: list[PositionLogprobs | None]
                   ) -> list[PositionLogprobs | None]:
        """``raw`` as output dicts; ``done`` caches the positions converted at earlier steps, so each position
        is detokenized once, not at every step that reports the request."""
        done.extend(None if x is None else self._position_logprobs(x) for x in raw[len(done):])
        return list(done)

    def _position_logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        entry: PositionLogprobs = {}
        for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            entry[tid] = Logprob(val, rank, self.tokenizer.decode([tid]))
        if lp.token_id not in entry:
            # rank of the chosen token among all: 1 + number of top entries strictly above it (>= when not listed)
            above = 1 + sum(v > lp.logprob for v in lp.top_logprobs) if lp.top_logprobs else None
            entry[lp.token_id] = Logprob(lp.logprob, above, self.tokenizer.decode([lp.token_id]))
        return entry
