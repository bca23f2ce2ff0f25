"""The routes every endpoint answers from its own state, on a real ``kv8 serve`` (the ``server`` fixture of
tests/entrypoints/conftest.py): ``/health``, ``/v1/models`` and ``/metrics`` (its exposition, and the histogram's).
"""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.helpers.server import Server, metrics, wait_idle


def test_health_and_models(server: Server, client: openai.OpenAI, tiny_llama: str) -> None:
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_llama]


def test_metrics_exposition(server: Server, client: openai.OpenAI, tiny_llama: str) -> None:
    before = wait_idle(server)
    for _ in range(2):  # 40 prompt tokens = 2 full blocks: the second request hits the prefix cache
        r = client.completions.create(model=tiny_llama, prompt=list(range(10, 50)), max_tokens=4, temperature=0.0)
    after = metrics(server)
    assert after["kv8:generation_tokens_total"] - before["kv8:generation_tokens_total"] == 2 * r.usage.completion_tokens
    assert after["kv8:prompt_tokens_total"] - before["kv8:prompt_tokens_total"] == 80
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name, kind in [("kv8:kv_cache_usage_perc", "gauge"), ("kv8:num_requests_running", "gauge"),
                       ("kv8:num_requests_waiting", "gauge"), ("kv8:prefix_cache_hit_rate", "gauge"),
                       ("kv8:generation_tokens_total", "counter"), ("kv8:time_to_first_token_seconds", "histogram"),
                       ("kv8:time_per_output_token_seconds", "histogram")]:
        assert f"# TYPE {name} {kind}" in text
    m = metrics(server)
    assert m["kv8:time_to_first_token_seconds_count"] >= 1
    assert m['kv8:time_to_first_token_seconds_bucket{le="+Inf"}'] == m["kv8:time_to_first_token_seconds_count"]
    assert m["kv8:time_per_output_token_seconds_count"] >= 1
    assert 0.0 < m["kv8:prefix_cache_hit_rate"] <= 1.0
    assert re.search(r"^kv8:kv_cache_total_blocks 128$", text, re.M)


def test_histogram_exposition() -> None:
    from kv8.entrypoints.openai.metrics import Histogram

    h = Histogram("x_seconds", "help", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.render()[2:] == ['x_seconds_bucket{le="0.1"} 2', 'x_seconds_bucket{le="1.0"} 3',
                              'x_seconds_bucket{le="+Inf"} 4', "x_seconds_sum 3.65", "x_seconds_count 4"]
    with pytest.raises(ValueError, match="strictly ascending"):
        Histogram("y", "help", (1.0, 0.5))
