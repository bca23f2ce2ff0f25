"""Fixtures shared by every test, and the test process's environment.

The environment comes first: ``TRITON_INTERPRET`` is read when a Triton kernel is decorated, so it is set here before
any test module (or helper) imports one. The fixtures are the session's tiny random models (built by
:mod:`tests.helpers.tiny_models`, transformers being the oracle for their logits) and the engines' thread count.
Helpers that tests import live in tests/helpers/, never here.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# dense_backend=auto by the fixed rule: the tests' engines do not time candidates (tests/layers/test_tuning.py
# turns tuning on where it tests it), so what a test runs does not depend on the machine's timings
os.environ.setdefault("KV8_TUNING", "off")
if not torch.cuda.is_available():
    # kv8's Triton kernels (the GPU path) run in Triton's interpreter on CPU tensors; the variable is read when a
    # kernel is decorated, so it is set before any test module imports one (tests/helpers/triton.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers.tiny_models import POISONED_TOKEN, TINY_CONFIGS, make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name in TINY_CONFIGS:
        out[name] = make_tiny_model(str(tmp_path_factory.mktemp(name)), name)
    return out


@pytest.fixture(scope="session")
def d32_models(tmp_path_factory) -> dict[str, str]:
    """Tiny GQA and sliding-window models with head_dim 32 (tiny_models' llama_gqa / mistral_swa have 16): what
    int4_per_group32 (whole groups of 32) needs."""
    root = tmp_path_factory.mktemp("d32")
    return {name: make_tiny_model(str(root / name), name, head_dim=32) for name in ("llama_gqa", "mistral_swa")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(autouse=True)
def _engines_keep_their_threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built in a test keep their thread count: the governor (:mod:`kv8.engine.threads`) would follow
    whatever else runs on the test machine, and with the torch dense backend (float32 models) a thread count
    changes the last bits of some matmuls, so two runs a test compares bit for bit could differ. Tests marked
    ``adaptive_threads`` (the governor's own) run it as it is."""
    if request.node.get_closest_marker("adaptive_threads") is None:
        from kv8.engine.threads import ThreadGovernor

        monkeypatch.setattr(ThreadGovernor, "target", lambda self, others: self.threads)


@pytest.fixture(scope="session")
def nan_llama(tiny_llama, tmp_path_factory) -> str:
    """The tiny Llama with a NaN in the embedding of :data:`~tests.helpers.tiny_models.POISONED_TOKEN`: a request
    whose prompt holds that token gets NaN logits (a broken checkpoint as users meet it), the others are unaffected."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path_factory.mktemp("nan_llama") / "model"
    shutil.copytree(tiny_llama, bad)
    weights_file = next(bad.glob("*.safetensors"))
    weights = load_file(str(weights_file))
    weights["model.embed_tokens.weight"][POISONED_TOKEN] = float("nan")
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    return str(bad)
