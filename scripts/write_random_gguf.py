"""Write a random-weight Llama-shaped GGUF file whose weight matrices are all Q4_K super-blocks: a model of the size
CPU users run (Llama-3.1-8B's shapes by default, ~4.5 GB) to load and decode with ``quantization="gguf"`` without
downloading one.

    .venv/bin/python scripts/write_random_gguf.py /tmp/llama8b-q4_k.gguf \\
        --tokenizer-from ~/.cache/kv8-peers/llama.cpp/models/ggml-vocab-llama-bpe.gguf

What the file holds (architecture ``llama``, :data:`LLAMA_31_8B` unless the shape options say otherwise):

* every weight matrix -- ``token_embd``, ``output`` (untied) and each layer's ``attn_q/k/v/output``,
  ``ffn_gate/up/down`` -- as Q4_K (:func:`random_q4_k`): random 4-bit codes ``c`` and per sub-block of 32 a random
  6-bit scale ``sc`` in 1..63 with the min ``m = sc``, the super-block's ``dmin = 7.5 d``, so each value is ``d sc
  (c - 7.5)``: zero mean, standard deviation ``std`` (default 0.02, a usual initialisation, so that 32 layers of
  random weights keep their activations finite); the rows of q/k are random, so llama.cpp's rotary row order does
  not matter;
* the norms (``attn_norm``, ``ffn_norm``, ``output_norm``) as float32 ones;
* Llama 3.1's hyper-parameters (RMS eps 1e-5, RoPE base 500,000, context 131,072) but not its ``llama3`` RoPE
  frequency scaling (a ``rope_freqs`` tensor, which kv8 does not read): RoPE is plain at every position;
* a tokenizer: ``--tokenizer-from FILE`` copies every ``tokenizer.*`` key of another GGUF file (llama.cpp's
  ``models/ggml-vocab-llama-bpe.gguf`` holds Llama 3's 128,256 tokens and 280,147 merges), whose vocabulary must
  have the model's size; otherwise :func:`byte_vocabulary`, a byte-level BPE vocabulary that tokenizes any text
  (GPT-2's 256 byte symbols, no merges) padded to the model's vocabulary with unused tokens.

The file is written one tensor at a time (``GGUFWriter.add_tensor_info`` for all, then ``write_tensor_data`` for each
as it is drawn), so the writer holds about one tensor (the 8B's largest, the embedding, 295 MB) whatever the file's
size. The tensor bytes are what ``quantization="gguf"`` keeps resident: :func:`tensor_bytes` returns them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType

Q4_K_VALUES = 256   # values per Q4_K super-block
Q4_K_BYTES = 144    # f16 d | f16 dmin | 12 bytes of 6-bit scales and mins | 128 bytes of 4-bit codes


@dataclass(frozen=True)
class ModelShape:
    """A Llama decoder's sizes. ``hidden`` and ``intermediate`` (the in_features of the Q4_K matrices) must be
    multiples of 256, ``hidden`` of ``heads``, ``heads`` of ``kv_heads``; ``vocab`` at least 258 (the byte
    vocabulary and its two special tokens)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int = 131072
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "context"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelShape.{field}={getattr(self, field)} must be positive")
        for field in ("hidden", "intermediate"):
            if getattr(self, field) % Q4_K_VALUES:
                raise ValueError(f"ModelShape.{field}={getattr(self, field)} must be a multiple of {Q4_K_VALUES} "
                                 f"(a Q4_K super-block)")
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"ModelShape: hidden={self.hidden} must split into heads={self.heads} of an even size, "
                             f"and heads into kv_heads={self.kv_heads}")
        if self.vocab < 258:
            raise ValueError(f"ModelShape.vocab={self.vocab} must be at least 258 (256 byte tokens and 2 special)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


#: Llama-3.1-8B's sizes (its config.json)
LLAMA_31_8B = ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256)


def random_q4_k(rows: int, in_features: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """Random Q4_K blocks, uint8 ``[rows, in_features / 256 * 144]``: per super-block ``d`` (float16) with
    ``std = d * sqrt(E[sc^2]) * sqrt(E[(c - 7.5)^2])`` and ``dmin = 7.5 d``; per sub-block ``sc`` uniform in 1..63 and
    ``m = sc``; codes ``c`` uniform in 0..15; so every value is ``d sc (c - 7.5)``."""
    if in_features % Q4_K_VALUES:
        raise ValueError(f"in_features={in_features} is not a multiple of {Q4_K_VALUES} (Q4_K)")
    count = rows * (in_features // Q4_K_VALUES)
    spread = np.sqrt(np.mean(np.arange(1, 64) ** 2.0)) * np.sqrt(np.mean((np.arange(16) - 7.5) ** 2))
    d = np.float16(std / spread)
    header = np.array([d, np.float16(7.5 * np.float32(d))], dtype=np.float16).view(np.uint8)   # d | dmin
    sc = rng.integers(1, 64, size=(count, 8), dtype=np.uint8)
    blocks = np.empty((count, Q4_K_BYTES), dtype=np.uint8)
    blocks[:, 0:4] = header
    # the 12 bytes of gguf_blocks.q4_k_scale_min's packing, mins equal to scales
    blocks[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    blocks[:, 8:12] = blocks[:, 4:8]
    blocks[:, 12:16] = (sc[:, 4:] & 15) | ((sc[:, 4:] & 15) << 4)
    blocks[:, 16:] = np.frombuffer(rng.bytes(count * 128), dtype=np.uint8).reshape(count, 128)
    return blocks.reshape(rows, -1)


def tensor_plan(shape: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """``(GGUF name, Hugging Face shape)`` of every tensor in file order: 2-D ones are Q4_K weights, 1-D float32
    norms."""
    h, d = shape.hidden, shape.head_dim
    plan: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        plan += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (shape.heads * d, h)),
                 (f"blk.{i}.attn_k.weight", (shape.kv_heads * d, h)),
                 (f"blk.{i}.attn_v.weight", (shape.kv_heads * d, h)),
                 (f"blk.{i}.attn_output.weight", (h, shape.heads * d)), (f"blk.{i}.ffn_norm.weight", (h,)),
                 (f"blk.{i}.ffn_gate.weight", (shape.intermediate, h)),
                 (f"blk.{i}.ffn_up.weight", (shape.intermediate, h)),
                 (f"blk.{i}.ffn_down.weight", (h, shape.intermediate))]
    return plan + [("output_norm.weight", (h,)), ("output.weight", (shape.vocab, h))]


def tensor_bytes(shape: ModelShape) -> int:
    """The bytes of the file's tensors (without alignment padding): Q4_K matrices and float32 norms."""
    return sum(dims[0] * dims[1] // Q4_K_VALUES * Q4_K_BYTES if len(dims) == 2 else 4 * dims[0]
               for _, dims in tensor_plan(shape))


def _gpt2_byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte 0..255 (``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def byte_vocabulary(vocab: int) -> dict[str, Any]:
    """``tokenizer.*`` metadata of a byte-level BPE tokenizer of ``vocab`` tokens: the 256 byte symbols (normal
    tokens: any text tokenizes, one token per byte), ``BOS`` and ``EOS`` (control tokens 256 and 257), then unused
    tokens ``<|unused_N|>``; one merge (``Ġ t``; transformers wants a merge list) whose result is token 258."""
    tokens = [*_gpt2_byte_symbols(), BOS, EOS, "Ġt"]
    tokens += [f"<|unused_{i}|>" for i in range(vocab - len(tokens))]
    types = [1] * vocab
    types[256] = types[257] = 3
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens[:vocab],
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["Ġ t"],
            "tokenizer.ggml.bos_token_id": 256, "tokenizer.ggml.eos_token_id": 257}


def copied_tokenizer(path: str, vocab: int) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """Every ``tokenizer.*`` key of the GGUF file ``path`` as ``(key, value, type, array item type)``. ``ValueError``
    when its vocabulary does not have ``vocab`` tokens."""
    reader = gguf.GGUFReader(path)
    keys = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        array = field.types[0] == GGUFValueType.ARRAY
        keys.append((key, field.contents(), field.types[0], field.types[1] if array else None))
    tokens = next((value for key, value, _, _ in keys if key == "tokenizer.ggml.tokens"), None)
    if tokens is None or len(tokens) != vocab:
        raise ValueError(f"{path}: its vocabulary has {None if tokens is None else len(tokens)} tokens, the model "
                         f"{vocab}; pass a tokenizer of the model's size or --vocab")
    return keys


def _tensors(shape: ModelShape, rng: np.random.Generator, std: float) -> Iterator[np.ndarray]:
    """The data of :func:`tensor_plan`'s tensors, in order, each drawn when asked for."""
    for _, dims in tensor_plan(shape):
        yield random_q4_k(dims[0], dims[1], rng, std) if len(dims) == 2 else np.ones(dims, dtype=np.float32)


def write_random_gguf(path: str, shape: ModelShape = LLAMA_31_8B, *, seed: int = 0, std: float = 0.02,
                      tokenizer_from: str | None = None, name: str = "random-llama") -> int:
    """Write the model (see the module docstring) to ``path`` one tensor at a time; returns :func:`tensor_bytes`."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(name)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if tokenizer_from is not None:
        for key, value, vtype, sub_type in copied_tokenizer(tokenizer_from, shape.vocab):
            writer.add_key_value(key, value, vtype, sub_type)
    else:
        for key, value in byte_vocabulary(shape.vocab).items():
            if isinstance(value, list):
                writer.add_array(key, value)
            elif isinstance(value, str):
                writer.add_string(key, value)
            else:
                writer.add_uint32(key, value)
    for tensor_name, dims in tensor_plan(shape):
        if len(dims) == 2:
            nbytes = dims[0] * dims[1] // Q4_K_VALUES * Q4_K_BYTES
            writer.add_tensor_info(tensor_name, (dims[0], nbytes // dims[0]), np.dtype(np.uint8), nbytes,
                                   raw_dtype=QT.Q4_K)
        else:
            writer.add_tensor_info(tensor_name, dims, np.dtype(np.float32), 4 * dims[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in _tensors(shape, np.random.default_rng(seed), std):
        writer.write_tensor_data(data)
    writer.close()
    return tensor_bytes(shape)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the .gguf file to write")
    parser.add_argument("--tokenizer-from", metavar="GGUF", help="copy tokenizer.* metadata from this GGUF file "
                        "(its vocabulary must have --vocab tokens); default: a byte-level vocabulary")
    base = LLAMA_31_8B
    for field in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "context"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(base, field),
                            help=f"(default: {getattr(base, field)}, Llama-3.1-8B's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.02, help="standard deviation of the weights (default: 0.02)")
    args = parser.parse_args(argv)
    try:
        shape = ModelShape(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab,
                           args.context, base.rope_theta, base.rms_eps)
        size = write_random_gguf(args.path, shape, seed=args.seed, std=args.std, tokenizer_from=args.tokenizer_from)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.path}: {os.path.getsize(args.path) / 2**20:.1f} MiB ({size / 2**20:.1f} MiB of tensors; "
          f"{shape.layers} layers, hidden {shape.hidden}, vocabulary {shape.vocab})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
