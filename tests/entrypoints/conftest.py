"""Fixtures of the server tests: a real ``kv8 serve`` of the tiny Llama (one per test module: a module's tests share
it, its SIGTERM test ends it), the official ``openai`` client of it, and the offline :class:`LLM` with the same
options, their oracle."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kv8 import LLM
from tests.helpers.server import API_KEY, ENGINE_FLAGS, SERVER_FLAGS, Server


@pytest.fixture(scope="module")
def server(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    # one intra-op thread: the tiny model gains nothing from two, and OpenMP barriers stall when the CPUs are busy
    srv = Server(["serve", "--model-id", tiny_llama, "--api-key", API_KEY, *ENGINE_FLAGS, *SERVER_FLAGS], log,
                 env={"OMP_NUM_THREADS": "1"})
    yield srv
    assert srv.stop() == 0, srv.read_log()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60.0)


@pytest.fixture(scope="module")
def offline(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, dtype="float32", num_kv_blocks=128, block_size=16, max_model_len=256, max_num_seqs=8)
