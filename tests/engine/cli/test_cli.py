"""The ``baton generate`` command: constraints, streaming and clear errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from baton.engine.cli.main import main

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def _generate(tiny_model_dir, capsys, *args: str) -> tuple[int, str, str]:
    argv = ["generate", "--model", str(tiny_model_dir), "--max-model-len", "256", *args]
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out.strip(), out.err


def test_choice_and_regex(tiny_model_dir, capsys):
    code, text, _ = _generate(tiny_model_dir, capsys, "--choice", "yes,no", "Answer:")
    assert code == 0 and text in ("yes", "no")
    code, text, _ = _generate(
        tiny_model_dir, capsys, "--regex", "[0-9]{3}", "--no-async-scheduling", "--raw", "N:"
    )
    assert code == 0 and re.fullmatch("[0-9]{3}", text)


def test_json_schema_from_file_and_inline_streamed(tiny_model_dir, capsys, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    for source in (str(path), json.dumps(SCHEMA)):
        code, text, _ = _generate(
            tiny_model_dir, capsys, "--json-schema", source, "--max-tokens", "64", "--stream", "x"
        )
        assert code == 0
        jsonschema.validate(json.loads(text), SCHEMA)


def test_bad_constraints_are_one_line_errors(tiny_model_dir, capsys, tmp_path):
    code, _, err = _generate(tiny_model_dir, capsys, "--json-schema", str(tmp_path / "nope"), "x")
    assert code == 2 and "cannot read" in err and "Traceback" not in err
    code, _, err = _generate(tiny_model_dir, capsys, "--json-schema", "{not json", "x")
    assert code == 2 and "not valid JSON" in err
    code, _, err = _generate(tiny_model_dir, capsys, "--regex", "(", "x")
    assert code == 2 and "regex" in err.lower()
    with pytest.raises(SystemExit):
        main(["generate", "--regex", "a", "--choice", "b", "x"])  # mutually exclusive


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_a_cuda_device_without_cuda_is_a_one_line_error(tiny_model_dir, capsys):
    code, _, err = _generate(tiny_model_dir, capsys, "--device", "cuda", "x")
    assert code == 2 and "needs CUDA" in err and "Traceback" not in err
    code, _, err = _generate(tiny_model_dir, capsys, "--device", "gpu0", "x")
    assert code == 2 and "'cpu', 'cuda', 'cuda:N' or 'sim:<gpu>'" in err
