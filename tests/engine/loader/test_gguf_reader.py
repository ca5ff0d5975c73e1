"""baton's GGUF reader against its reference, ``gguf.GGUFReader``: the same metadata (values
and Python types) and the same tensor views, on the default model and on a file holding every
metadata value type; clear errors for what is not GGUF."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from baton.engine.loader.gguf_reader import GGUFFormatError, read_gguf_file


def _assert_same_as_reference(path: Path) -> None:
    ours = read_gguf_file(path)
    ref = gguf.GGUFReader(path)
    expected = {key: field.contents() for key, field in ref.fields.items()}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ref.tensors, ours.tensors, strict=True):
        assert (a.name, a.tensor_type, tuple(a.shape.tolist())) == (b.name, b.tensor_type, b.shape)
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name


def test_the_default_model_reads_as_the_reference_reads_it(default_model_path: Path) -> None:
    _assert_same_as_reference(default_model_path)


def test_every_value_type_and_tensor_kind(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    scalars: dict[str, tuple[Any, Any]] = {
        "u8": (writer.add_uint8, 200),
        "i8": (writer.add_int8, -100),
        "u16": (writer.add_uint16, 60000),
        "i16": (writer.add_int16, -30000),
        "u32": (writer.add_uint32, 4_000_000_000),
        "i32": (writer.add_int32, -2_000_000_000),
        "u64": (writer.add_uint64, 2**63 + 5),
        "i64": (writer.add_int64, -(2**62)),
        "f32": (writer.add_float32, 0.1),
        "f64": (writer.add_float64, 0.1),
        "yes": (writer.add_bool, True),
        "text": (writer.add_string, "héllo\n\u2603"),
    }
    for key, (add, value) in scalars.items():
        add(f"t.{key}", value)
    writer.add_array("t.words", ["a", "", "ünï", "x" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.empty", [])
    writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("f16", np.arange(64, dtype=np.float16).reshape(2, 32))
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), 8)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_same_as_reference(path)
    metadata = read_gguf_file(path).metadata
    assert metadata["t.u64"] == 2**63 + 5 and metadata["t.words"][2] == "ünï"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "empty"),
        (b"GGML" + bytes(20), "does not start with"),
        (b"GGUF" + (7).to_bytes(4, "little") + bytes(16), "version 7"),
        (b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little"), "ends inside"),
        # One key whose string length points far past the end.
        (
            b"GGUF"
            + (3).to_bytes(4, "little")
            + (0).to_bytes(8, "little")
            + (1).to_bytes(8, "little")
            + (10**9).to_bytes(8, "little"),
            "runs past the end",
        ),
    ],
)
def test_what_is_not_gguf_is_refused_by_name(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError, match=match):
        read_gguf_file(path)


def test_release_pages_drops_a_tensors_pages_and_keeps_its_bytes(tmp_path: Path) -> None:
    """A loader releases a tensor it has copied: its file pages leave this process's resident
    memory (the file stays readable, the same bytes)."""
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    values = np.arange(16 * 2**20, dtype=np.float32)  # 64 MiB
    writer.add_tensor("big", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = read_gguf_file(path).tensors

    def resident_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    total = float(tensor.data.sum(dtype=np.float64))  # maps every page
    mapped = resident_mib()
    tensor.release_pages()
    assert mapped - resident_mib() > 48
    assert float(tensor.data.sum(dtype=np.float64)) == total
