"""``quantization="gguf"``: the token embedding and the LM head held as the file's blocks (kv8.layers.vocab_parallel,
kv8.quant.gguf_blocks.dequantize_rows, GGUFLinearMethod on the head), a tied pair sharing one copy; a table of a type
without a kernel dequantized as without the option; what ``kv8 info`` and the load line say, and the resident bytes.
Oracles: the ``gguf`` package's dequantize (float32) of the file's tensors, float32 products with the int8 kernel's
documented bound (:func:`~kv8.quant.gguf_blocks.gguf_activation_bound`), and the same engine on the file dequantized
to bf16 (``quantization`` unset)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kv8 import LLM, SamplingParams
from kv8.layers.linear import GGUFLinearMethod, GGUFSegment, LinearBase, linear_reference
from kv8.layers.vocab_parallel import GGUF_HEAD_DEQUANTIZE_ROWS
from kv8.loader.gguf import gguf_resident_bytes, read_gguf
from kv8.loader.model import describe_gguf_blocks, describe_weights, load_model, resident_weight_bytes
from kv8.loader.sources import default_model_path
from kv8.quant.gguf_blocks import KEPT_TYPES, gguf_activation_bound
from tests.helpers.engine import NEAR_TIE
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.kernels import dense_kernels_or_reason

LINEAR = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
          "ffn_down.weight")
# a vocabulary of 45 rows: five groups of 8 of the kernel's layout and a last group of 5
SIZES = dict(hidden=64, heads=2, kv_heads=1, inter=96, vocab=45)
SIZES_256 = dict(hidden=256, heads=2, kv_heads=1, inter=256, vocab=45)
_KERNELS, _ = dense_kernels_or_reason()


def _write(path: Path, table: QT, untied: bool, decoder: QT = QT.Q4_1) -> None:
    """A tiny llama whose embedding (and untied LM head) have type ``table``, its decoder ``decoder``; std 0.4 (0.2
    at the width Q4_K needs), as tests/loader/test_gguf_blocks_loading.py's tiny models."""
    types = dict.fromkeys(LINEAR, decoder) | {"token_embd.weight": table, "output.weight": table}
    wide = QT.Q4_K in types.values() or QT.Q6_K in types.values()
    write_tiny_gguf(path, types=types, untied=untied, bpe=True, scale=0.2 if wide else 0.4,  # type: ignore[arg-type]
                    **(SIZES_256 if wide else SIZES))


def _file_tensor(path: Path, name: str) -> tuple[torch.Tensor, int]:
    """The file's tensor ``name`` dequantized by the ``gguf`` package (float32, HF shape), and its bytes."""
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == name)
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(values.reshape([int(d) for d in reversed(tensor.shape.tolist())]).copy()), \
        int(tensor.n_bytes)


def _head_within_bound(head: torch.nn.Module, w: torch.Tensor, qtype: str, rows: int, kernel: bool) -> None:
    """The head's logits of ``rows`` random hidden states against ``x @ W.T`` in float64 on the file's values: within
    the int8 activations' bound where the kernel runs (``kernel``), plus float32 sums and the one bf16 rounding."""
    x = (torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows)) * 2).bfloat16()
    y = head(x)
    assert y.shape == (rows, w.shape[0]) and y.dtype == torch.bfloat16
    exact = x.double() @ w.double().T
    slack = 2.0 ** -8 * exact.abs() * 1.01 + 1e-5 * (x.double().abs() @ w.double().abs().T)
    bound = gguf_activation_bound(x, head.gguf_segments[0].file_blocks(), qtype) if kernel else 0.0
    assert bool(((y.double() - exact).abs() <= bound + slack).all())


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_embedding_and_head_keep_the_files_blocks(tmp_path: Path, qtype: str, untied: bool) -> None:
    """The embedding holds the file's bytes of ``token_embd`` (no bf16 table) and returns exactly the ``gguf``
    package's rows in bf16, for ids in every group of 8 rows and in the last, short group; the LM head multiplies by
    the blocks -- of ``output.weight``, or (tied) the embedding's very segment: one copy -- within the int8 kernel's
    bound below ``GGUF_HEAD_DEQUANTIZE_ROWS`` rows and within float32 sums from there (the blocks dequantized); the
    model's resident bytes are what ``kv8 info`` computes from the file."""
    path = tmp_path / "m.gguf"
    _write(path, QT[qtype], untied)
    loaded = load_model("gguf", str(path), torch.bfloat16, "auto", quantization="gguf")
    embedding, head = loaded.model.model.embed_tokens, loaded.model.lm_head
    table, table_bytes = _file_tensor(path, "token_embd.weight")
    assert embedding.gguf_rows is not None and not hasattr(embedding, "weight")
    assert (embedding.gguf_rows.qtype, embedding.gguf_rows.nbytes()) == (qtype, table_bytes)
    assert embedding.gguf_rows.grouped == (_KERNELS is not None)
    ids = torch.tensor([44, 0, 7, 8, 40, 43, 44, 21, 0, 39])   # both sides of group edges, the last group, repeats
    assert torch.equal(embedding(ids), table[ids].bfloat16())
    assert torch.equal(embedding(torch.arange(45)), table.bfloat16())

    assert isinstance(head.method, GGUFLinearMethod) and len(head.gguf_segments) == 1
    segment = head.gguf_segments[0]
    if untied:
        w, head_bytes = _file_tensor(path, "output.weight")
        assert segment is not embedding.gguf_rows and (segment.qtype, segment.nbytes()) == (qtype, head_bytes)
    else:
        w = table
        assert segment is embedding.gguf_rows
    kernel = segment.grouped and _KERNELS is not None
    _head_within_bound(head, w, qtype, 3, kernel)
    _head_within_bound(head, w, qtype, GGUF_HEAD_DEQUANTIZE_ROWS + 3, False)

    model, reader = read_gguf(str(path))
    predicted = gguf_resident_bytes(reader, model, torch.bfloat16, _KERNELS is not None)
    assert abs(resident_weight_bytes(loaded.model) - predicted) <= 1024   # the rotary buffers beside
    text = describe_gguf_blocks(loaded.model)
    assert f"; embedding {qtype} blocks, " in text
    assert ("; LM head tied: the embedding's blocks;" in text) != untied


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_a_table_without_a_kernel_is_dequantized_as_without_the_option(tmp_path: Path, untied: bool,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A Q5_1 embedding (no kernel reads Q5_1): the bf16 table, as without ``quantization="gguf"`` and without the
    decoder's warning; the LM head (its own Q5_1 tensor, or tied: the same table) holds it dequantized, packed for the
    bf16 kernel where the kernels run, and multiplies as a bf16 weight does."""
    path = tmp_path / "m.gguf"
    _write(path, QT.Q5_1, untied, decoder=QT.Q8_0)
    with caplog.at_level(logging.WARNING, logger="kv8"):
        loaded = load_model("gguf", str(path), torch.bfloat16, "auto", quantization="gguf")
    assert not [r for r in caplog.records if "without a kv8 kernel" in r.getMessage()]
    embedding, head = loaded.model.model.embed_tokens, loaded.model.lm_head
    table, _ = _file_tensor(path, "token_embd.weight")
    assert embedding.gguf_rows is None and embedding.gguf_qtype == "Q5_1"
    assert torch.equal(embedding.weight, table.bfloat16())
    assert [(s.qtype, s.expanded) for s in head.gguf_segments] == [("Q5_1", True)]
    w = _file_tensor(path, "output.weight")[0] if untied else table
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.allclose(head(x).float(), linear_reference(x, w.bfloat16(), None).float(), rtol=2 ** -7, atol=1e-3)
    assert "; embedding Q5_1 dequantized at load, " in describe_gguf_blocks(loaded.model)
    model, reader = read_gguf(str(path))
    predicted = gguf_resident_bytes(reader, model, torch.bfloat16, _KERNELS is not None)
    assert abs(resident_weight_bytes(loaded.model) - predicted) <= 0.05 * predicted   # packing pads the rows


def test_info_says_how_the_embedding_and_head_are_held(tmp_path: Path) -> None:
    """``kv8 info``'s weights line names the embedding's and the head's types and how they are held, and the weights'
    resident bytes beside the file's size."""
    tied, untied = tmp_path / "tied.gguf", tmp_path / "untied.gguf"
    _write(tied, QT.Q8_0, False)
    _write(untied, QT.Q8_0, True)
    _write(tmp_path / "q51.gguf", QT.Q5_1, False)
    embd = _file_tensor(tied, "token_embd.weight")[1] / 2**20
    text = describe_weights("gguf", str(tied), "gguf")
    assert f"; embedding Q8_0 blocks, {embd:.1f} MiB; LM head tied: the embedding's blocks; resident weights " in text
    assert text.endswith(f" MiB (the file: {os.path.getsize(tied) / 2**20:.1f} MiB)")
    assert f"; LM head Q8_0 blocks, {embd:.1f} MiB;" in describe_weights("gguf", str(untied), "gguf")
    assert "; embedding Q5_1 dequantized to bfloat16 at load, " in describe_weights("gguf", str(tmp_path / "q51.gguf"),
                                                                                    "gguf")


PROMPT = [1, 5, 7, 9, 11, 13, 3, 17, 19, 21, 23, 25]


def _generate(path: Path, **options: object) -> tuple[list[list[int]], list[list[dict[int, float]]], torch.Tensor,
                                                     int]:
    """Greedy tokens of three prompts (each cut at its first step whose two best logits tie in bf16: argmax takes
    either) with each kept step's three best log-probabilities, the prompts' log-probabilities, and how many decode
    steps replayed a CPU graph."""
    llm = LLM(str(path), kv_cache_memory="8MiB", max_model_len=128, **options)
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, logprobs=3, ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT[3:], [4, 44, 40]], params, use_tqdm=False)
    tokens, steps = [], []
    for out in outs:
        kept, best3 = [], []
        for token, step in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
            best = sorted((lp.logprob for lp in step.values()), reverse=True)
            if best[0] == best[1]:
                break
            kept.append(token)
            best3.append({t: lp.logprob for t, lp in step.items()})
        tokens.append(kept)
        steps.append(best3)
    logprobs = torch.tensor([p[t].logprob for out in outs
                             for t, p in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])])
    graphs = llm.engine.runner.graphs
    replays = 0 if graphs is None else graphs.replays
    llm.close()
    return tokens, steps, logprobs, replays


def _assert_same_greedy_tokens(a: list[int], b: list[int], steps_a: list[dict[int, float]],
                               steps_b: list[dict[int, float]]) -> None:
    """Two runs' greedy tokens agree for at least 3 steps, then to the end or to a near-tie of both runs: where they
    part, each run holds both tokens within NEAR_TIE (0.05 nats) of each other (the int8 activations' rounding, or
    the attention's, swaps such a pair of a random model's flat logits); the contexts differ after it."""
    n = min(len(a), len(b))
    j = next((k for k in range(n) if a[k] != b[k]), n)
    assert j >= 3, (a, b)
    if j < n:
        for st in (steps_a[j], steps_b[j]):
            assert a[j] in st and b[j] in st and abs(st[a[j]] - st[b[j]]) <= NEAR_TIE, (j, a, b, st)


@pytest.mark.parametrize("table, decoder, untied", [(QT.Q8_0, QT.Q4_1, False), (QT.Q4_0, QT.Q8_0, True),
                                                    (QT.Q4_K, QT.Q4_K, True), (QT.Q6_K, QT.Q6_K, False)])
def test_engine_with_kept_tables_matches_the_dequantized_model(tmp_path: Path, table: QT, decoder: QT,
                                                                untied: bool) -> None:
    """An engine with the embedding and the LM head kept as blocks (tied and untied) gives the greedy tokens of the
    same file dequantized to bf16 (but at a near-tie, _assert_same_greedy_tokens), prompt log-probabilities within
    the int8 activations' rounding (the bound of
    tests/loader/test_gguf_blocks_loading.py, 0.15 nats), and its CPU-graph decode steps equal eager ones."""
    path = tmp_path / "m.gguf"
    _write(path, table, untied, decoder)
    tokens, steps, logprobs, _ = _generate(path, quantization="none")
    kept_tokens, kept_steps, kept_logprobs, replays = _generate(path, quantization="gguf")
    for a, b, sa, sb in zip(tokens, kept_tokens, steps, kept_steps):
        _assert_same_greedy_tokens(a, b, sa, sb)
    assert (kept_logprobs - logprobs).abs().max().item() < 0.15
    eager_tokens, _, eager_logprobs, eager_replays = _generate(path, quantization="gguf", enforce_eager=True)
    assert eager_replays == 0 and eager_tokens == kept_tokens and torch.equal(eager_logprobs, kept_logprobs)
    if _KERNELS is not None:
        assert replays > 0


def test_smollm2_weights_stay_within_ten_percent_of_the_file() -> None:
    """The default model (Q4_1 decoder, Q8_0 tied embedding) with ``quantization="gguf"``: the embedding and the LM
    head share the file's Q8_0 blocks, and every weight the model keeps resident comes to within 10% of the file's
    size (92.0 MiB of 93.8 MiB; 171 MiB when the table was expanded to bf16 and packed again for the head), the figure
    ``kv8 info`` prints."""
    path = default_model_path()
    loaded = load_model("gguf", path, torch.bfloat16, "auto", quantization="gguf")
    embedding, head = loaded.model.model.embed_tokens, loaded.model.lm_head
    assert embedding.gguf_rows is not None and head.gguf_segments[0] is embedding.gguf_rows
    _, table_bytes = _file_tensor(Path(path), "token_embd.weight")
    assert embedding.gguf_rows.qtype == "Q8_0" and embedding.gguf_rows.nbytes() == table_bytes
    resident, size = resident_weight_bytes(loaded.model), os.path.getsize(path)
    assert abs(resident - size) <= 0.1 * size, (resident, size)
    model, reader = read_gguf(path)
    assert abs(resident - gguf_resident_bytes(reader, model, torch.bfloat16, _KERNELS is not None)) <= 1024
    assert f"resident weights {resident / 2**20:.1f} MiB" in describe_weights("gguf", path, "gguf")


def test_q6_k_layers_are_timed_in_q6_k(tmp_path: Path) -> None:
    """A file whose decoder and tied table are Q6_K: the tuning shapes are the decoder's layers and the head in Q6_K
    (gguf_weight_types: each weight's type in the file)."""
    from kv8.loader.model import tuning_shapes

    path = tmp_path / "m.gguf"
    _write(path, QT.Q6_K, untied=False, decoder=QT.Q6_K)
    model, _ = read_gguf(str(path))
    shapes = tuning_shapes("gguf", str(path), dict(model.hf_config), "gguf")
    assert {(s.quantize, s.qtype, s.lm_head) for s in shapes} == {(True, "Q6_K", False), (True, "Q6_K", True)}


# Gemma-3-270M's Q4_K_M file in small: a shape in two types (o_proj and one down_proj Q4_K, the other down_proj
# Q6_K, all 256 x 256) and a merged layer of two types (q, k Q4_K; v Q8_0)
MIXED = dict.fromkeys(LINEAR, QT.Q4_K) | {"attn_v.weight": QT.Q8_0, "blk.1.ffn_down.weight": QT.Q6_K,
                                          "token_embd.weight": QT.Q8_0}


def test_a_shape_in_two_types_is_two_tuning_shapes(tmp_path: Path) -> None:
    """The tuning shapes carry each layer's block types: a shape of one (N, K) in two types is two shapes with their
    counts, a merged layer whose projections differ in type is a shape per run of one type (its segments), the head
    its own type; without ``quantization="gguf"`` no type."""
    from kv8.layers.tuning import LinearShape
    from kv8.loader.model import tuning_shapes

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, types=MIXED, bpe=True, scale=0.2, **SIZES_256)  # type: ignore[arg-type]
    model, _ = read_gguf(str(path))
    assert tuning_shapes("gguf", str(path), dict(model.hf_config), "gguf") == [
        LinearShape(45, 256, 1, True, "Q8_0", lm_head=True),   # the tied head
        LinearShape(128, 256, 2, True, "Q8_0"),   # v
        LinearShape(256, 256, 3, True, "Q4_K"),   # o_proj x 2, layer 0's down_proj
        LinearShape(256, 256, 1, True, "Q6_K"),   # layer 1's down_proj
        LinearShape(384, 256, 2, True, "Q4_K"),   # q, k
        LinearShape(512, 256, 2, True, "Q4_K"),   # gate, up
    ]
    assert all(s.qtype is None for s in tuning_shapes("gguf", str(path), dict(model.hf_config), None))


@pytest.mark.skipif(_KERNELS is None, reason="the GGUF switch is timed only where kv8's kernels read the blocks")
@pytest.mark.parametrize("q4_k_int8_wins", [True, False])
def test_dense_backend_auto_times_and_switches_each_block_type(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               q4_k_int8_wins: bool) -> None:
    """``dense_backend="auto"`` with tuning on times ``quantization="gguf"``'s decoder layers in their own block types
    (not the head: its switch is its own, ``GGUF_HEAD_DEQUANTIZE_ROWS``), and each layer's segment switches at its
    type's choice: here Q6_K and Q8_0 measure faster dequantized from ``GGUF_DEQUANTIZE_ROWS`` rows, Q4_K faster on
    the int8 kernel at every row count (or not); the bf16 expansion from ``GGUF_BF16_ROWS`` is timed too, and loses.
    (The timings are faked: which path is faster depends on the CPU.)"""
    from kv8.layers.dense_backend import GGUF_BF16_ROWS, GGUF_DEQUANTIZE_ROWS, DenseBackend
    from kv8.layers.tuning import LinearShape, _LayerTimer, _PathTimer

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, types=MIXED, bpe=True, scale=0.2, **SIZES_256)  # type: ignore[arg-type]
    timed: list[tuple[str, LinearShape]] = []
    int8_wins = {"Q4_K"} if q4_k_int8_wins else set()

    def fake(self: _LayerTimer, backend: DenseBackend, shape: LinearShape, rows: int) -> float:
        timed.append((backend.label, shape))
        dequantizes = bool(backend.wide_rows) and rows >= backend.wide_rows
        return 1.0 if rows == 1 else 2.0 if dequantizes == (shape.qtype in int8_wins) else 1.5

    monkeypatch.setattr(_LayerTimer, "measure", fake)
    monkeypatch.setattr(_PathTimer, "measure", lambda self, path, shape, rows: 1.0)   # every path alike: the default
    monkeypatch.setenv("KV8_TUNING", "auto")
    monkeypatch.setenv("KV8_CACHE_DIR", os.fspath(tmp_path / "cache"))
    loaded = load_model("gguf", str(path), torch.bfloat16, "auto", quantization="gguf")
    assert {label for label, _ in timed} == {f"packed_bf16+f32_from_{GGUF_DEQUANTIZE_ROWS}", "packed_bf16",
                                             f"packed_bf16+bf16_from_{GGUF_BF16_ROWS}"}
    assert {shape.qtype for _, shape in timed} == {"Q4_K", "Q6_K", "Q8_0"}
    assert not any(shape.lm_head for _, shape in timed)
    q4_k = 0 if q4_k_int8_wins else GGUF_DEQUANTIZE_ROWS
    layers = loaded.model.model.layers

    def switches(layer: LinearBase) -> list[tuple[str, int]]:
        assert isinstance(layer.method, GGUFLinearMethod)
        segments = [s for s in layer.gguf_segments if isinstance(s, GGUFSegment)]
        return [(s.qtype, layer.method.dequantize_rows_of(s.qtype)) for s in segments]

    assert switches(layers[0].self_attn.qkv_proj) == [("Q4_K", q4_k), ("Q8_0", GGUF_DEQUANTIZE_ROWS)]
    assert switches(layers[0].mlp.down_proj) == [("Q4_K", q4_k)]
    assert switches(layers[1].mlp.down_proj) == [("Q6_K", GGUF_DEQUANTIZE_ROWS)]
    assert switches(loaded.model.lm_head) == [("Q8_0", GGUF_HEAD_DEQUANTIZE_ROWS)]
    assert loaded.dense_backend == (f"packed_bf16[Q4_K:int8,Q6_K:f32_from_{GGUF_DEQUANTIZE_ROWS},Q8_0:f32_from_"
                                    f"{GGUF_DEQUANTIZE_ROWS}]" if q4_k_int8_wins else
                                    f"packed_bf16+f32_from_{GGUF_DEQUANTIZE_ROWS}")
