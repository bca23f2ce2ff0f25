"""scripts/dequantize_gguf.py: every tensor of the output is the input's dequantized by the ``gguf`` package (the
oracle), as F32, with its name and shape; every metadata key is kept but the file type, which says F32; kv8 reads
both files as the same model."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from kv8.loader.gguf import read_gguf
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.paths import ROOT, load_file_module

SCRIPT = ROOT / "scripts" / "dequantize_gguf.py"


def _script() -> ModuleType:
    return load_file_module(SCRIPT)


def test_every_tensor_is_the_inputs_dequantized_and_the_metadata_is_kept(tmp_path: Path) -> None:
    source, target = tmp_path / "q.gguf", tmp_path / "f32.gguf"
    types = {"attn_q.weight": QT.Q4_K, "attn_k.weight": QT.Q6_K, "attn_v.weight": QT.Q8_0, "ffn_down.weight": QT.Q5_0,
             "ffn_up.weight": QT.F16, "token_embd.weight": QT.Q4_1}
    write_tiny_gguf(source, types=types, hidden=256, heads=2, kv_heads=1, inter=256, vocab=40, bpe=True, scale=0.2)
    assert _script().main([str(source), str(target)]) == 0
    before, after = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(target))
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    for old, new in zip(before.tensors, after.tensors):
        assert new.tensor_type == QT.F32 and new.shape.tolist() == old.shape.tolist()
        expected = gguf.quants.dequantize(old.data, old.tensor_type).astype(np.float32)
        assert np.array_equal(np.asarray(new.data).reshape(expected.shape), expected), old.name
    kept = {k for k in before.fields if not k.startswith("GGUF.")}
    assert {k for k in after.fields if not k.startswith("GGUF.")} == kept | {"general.file_type"}
    for key in kept:
        assert after.fields[key].contents() == before.fields[key].contents(), key
    assert after.fields["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32
    assert read_gguf(str(target))[0].hf_config == read_gguf(str(source))[0].hf_config
