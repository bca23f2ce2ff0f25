"""The engine's parts without a model: token stop rules (``check_stop``), block tables in the scheduler's output,
``Scheduler.update``, and the output processor's text, stop strings and ``n > 1`` grouping (a character-level
fake tokenizer: token ``i`` is the letter ``chr(97 + i)``)."""

from __future__ import annotations

import torch

from kv8.cache.kv_cache_manager import KVCacheManager
from kv8.engine.config import SchedulerConfig
from kv8.engine.output_processor import OutputProcessor
from kv8.engine.request import Request, RequestStatus, TokenLogprobs
from kv8.engine.runner_output import ModelRunnerOutput
from kv8.engine.scheduler import Scheduler, check_stop
from kv8.sampling_params import SamplingParams

EOS = 25   # "z"


def req(rid: str, prompt: list[int], max_tokens: int = 8, index: int = 0, parent: str | None = None,
        **params) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(**params),
                   generator=torch.Generator(), max_tokens=max_tokens, eos_token_ids=frozenset({EOS}),
                   parent_id=parent, index=index)


def after(r: Request, *tokens: int) -> RequestStatus | None:
    status = None
    for t in tokens:
        r.append_output_token(t)
        status = check_stop(r)
    return status


def test_check_stop_token_rules() -> None:
    r = req("a", [1])
    assert after(r, 3, EOS) is RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    r = req("b", [1], stop_token_ids=[7])
    assert after(r, 7) is RequestStatus.FINISHED_STOPPED and r.stop_reason == 7
    r = req("c", [1], stop_token_ids=[EOS])          # both EOS and a stop token: EOS wins, no reason
    assert after(r, EOS) is RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    r = req("d", [1], ignore_eos=True, stop_token_ids=[EOS])
    assert after(r, EOS) is RequestStatus.FINISHED_STOPPED and r.stop_reason == EOS
    r = req("e", [1], max_tokens=3, ignore_eos=True)
    assert after(r, EOS, EOS) is None and after(r, EOS) is RequestStatus.FINISHED_LENGTH
    r = req("f", [1], min_tokens=2, stop_token_ids=[7])   # below min_tokens nothing stops on a token
    assert after(r, 7) is None and after(r, 7) is RequestStatus.FINISHED_STOPPED
    assert req("g", [1], stop_token_ids=[7]).stop_tokens == {7, EOS}
    assert req("h", [1], stop_token_ids=[7], ignore_eos=True).stop_tokens == {7}


def test_chunks_carry_block_tables_and_update_applies_the_step() -> None:
    kv = KVCacheManager.full_attention(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32), kv)
    a, b = req("a", list(range(6)), max_tokens=2), req("b", list(range(10, 13)), max_tokens=5)
    sched.add(a)
    sched.add(b)
    so = sched.schedule()
    assert [(c.request.request_id, c.start, c.num_new_tokens, c.block_ids) for c in so.chunks] == [
        ("a", 0, 6, ((0, 1),)), ("b", 0, 3, ((2,),))]
    lp = TokenLogprobs(4, -0.5, [4], [-0.5])
    updated = sched.update(so, ModelRunnerOutput(sampled={"a": 4, "b": EOS}, logprobs={"a": lp}, prompt_logprobs={}))
    assert updated == [a, b]
    assert a.output_token_ids == [4] and a.logprobs == [lp] and a.cumulative_logprob == -0.5
    assert b.status is RequestStatus.FINISHED_STOPPED and "b" not in kv.req_blocks   # EOS: blocks freed
    so = sched.schedule()
    assert [(c.request.request_id, c.start, c.num_new_tokens, c.block_ids) for c in so.chunks] == [
        ("a", 6, 1, ((0, 1),))]
    sched.update(so, ModelRunnerOutput(sampled={"a": 5}, logprobs={}, prompt_logprobs={}))
    assert a.status is RequestStatus.FINISHED_LENGTH and not kv.req_blocks
    kv.check_integrity()


class CharTokenizer:
    eos_token_id = EOS

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("" if (skip_special_tokens and i == EOS) else chr(97 + i) for i in ids)


def test_output_processor_stop_strings_and_grouping() -> None:
    op = OutputProcessor(CharTokenizer())
    stop = req("s", [1], stop=["cd"])
    keep = req("k", [1], stop=["cd"], include_stop_str_in_output=True)
    op.add_request("s", None, [stop])
    op.add_request("k", None, [keep])
    for t in (0, 1, 2):                       # "abc": no stop yet
        for r in (stop, keep):
            r.append_output_token(t)
        assert op.detokenize([stop, keep]) == []
    for r in (stop, keep):
        r.append_output_token(3)              # "abcd" completes "cd"
    assert op.detokenize([stop, keep]) == [stop, keep]
    for r in (stop, keep):
        r.status = RequestStatus.FINISHED_STOPPED   # what the engine's scheduler.finish does
    outs = {o.request_id: o.outputs[0] for o in op.make_outputs([stop, keep])}
    assert (outs["s"].text, outs["s"].stop_reason, outs["s"].finish_reason) == ("ab", "cd", "stop")
    assert outs["k"].text == "abcd" and not op.has_unfinished_requests()


def test_stop_string_in_the_last_allowed_token_reports_stop() -> None:
    op = OutputProcessor(CharTokenizer())
    r = req("r", [1], max_tokens=2, stop=["b"])
    op.add_request("r", None, [r])
    assert after(r, 0, 1) is RequestStatus.FINISHED_LENGTH
    r.status = RequestStatus.FINISHED_LENGTH
    assert op.detokenize([r]) == [r] and r.stop_reason == "b"


def test_n_samples_are_grouped_into_one_output() -> None:
    op = OutputProcessor(CharTokenizer())
    kids = [req(f"p-{i}", [1], index=i, parent="p", max_tokens=3) for i in range(2)]
    op.add_request("p", "prompt", kids)
    kids[0].append_output_token(0)
    op.detokenize(kids[:1])
    (out,) = op.make_outputs(kids[:1])
    assert out.request_id == "p" and [c.text for c in out.outputs] == ["a", ""] and not out.finished
    kids[1].append_output_token(1)
    kids[1].status = RequestStatus.FINISHED_LENGTH
    kids[0].status = RequestStatus.FINISHED_ABORTED
    op.detokenize(kids[1:])
    (out,) = op.make_outputs(kids[1:])
    assert [c.finish_reason for c in out.outputs] == ["abort", "length"] and out.finished
    assert not op.has_unfinished_requests()
