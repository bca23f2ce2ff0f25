"""kv8: an LLM inference engine whose KV cache is stored in 8-bit floating point."""

from kv8.entrypoints.llm import LLM
from kv8.outputs import CompletionOutput, Logprob, RequestOutput
from kv8.sampling_params import SamplingParams, StructuredOutputsParams
from kv8.version import __version__

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams",
           "__version__"]
