"""Write a GGUF file's weights dequantized to float32 as another GGUF file: the same model for llama.cpp (or any
reader) with every tensor as F32, so that its KL divergence against the quantized file measures the quantized file's
arithmetic alone (the weights are the same values).

    .venv/bin/python scripts/dequantize_gguf.py gemma-3-270m-q4_k_m.gguf gemma-3-270m-f32.gguf

What the output holds:

* every metadata key of the input as it is (the architecture's hyper-parameters, the tokenizer), but
  ``general.file_type``, which says ``ALL_F32``, and the reader's own ``GGUF.*`` entries, which the writer makes;
* every tensor, in the input's order and with its name and shape, as float32: ``gguf.quants.dequantize`` of its data
  (F32 tensors copied, F16 / BF16 widened; every quantized type the ``gguf`` package reads), which are the values
  llama.cpp's and kv8's dequantization give.

The file is written one tensor at a time (``add_tensor_info`` for all, then ``write_tensor_data`` for each as it is
dequantized), so the writer holds one float32 tensor at a time (Gemma-3-270M's embedding: 671 MB).
"""

from __future__ import annotations

import argparse
import sys

import gguf
import numpy as np
from gguf import GGUFValueType


def dequantized_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """The numpy shape of a tensor's values (its GGUF dimensions, fastest first, reversed)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def dequantize_gguf(source: str, target: str) -> int:
    """Write ``source``'s metadata and tensors, every tensor dequantized to float32 (see the module docstring), to
    ``target``; returns the tensors' bytes written."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        array = field.types[0] == GGUFValueType.ARRAY
        writer.add_key_value(key, field.contents(), field.types[0], field.types[1] if array else None)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    total = 0
    for tensor in reader.tensors:
        shape = dequantized_shape(tensor)
        nbytes = 4 * int(np.prod(shape))
        writer.add_tensor_info(tensor.name, shape, np.dtype(np.float32), nbytes)
        total += nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        writer.write_tensor_data(np.ascontiguousarray(values.reshape(dequantized_shape(tensor))))
    writer.close()
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="the GGUF file to read")
    parser.add_argument("target", help="the GGUF file to write, every tensor float32")
    args = parser.parse_args(argv)
    total = dequantize_gguf(args.source, args.target)
    print(f"wrote {args.target}: {total / 2**20:.1f} MiB of float32 tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
