"""The ``baton generate`` command: constraints, streaming and clear errors; the commands other
distributions add (``baton bench``) through entry points."""

from __future__ import annotations

import importlib.util
import json
import re
from importlib.metadata import EntryPoint
from pathlib import Path

import jsonschema
import pytest
import torch

import baton.engine.cli.main as cli_module
from baton.engine.cli.main import PLUGIN_GROUP, build_parser, main

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


def test_bench_without_baton_bench_installed_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli_module, "cli_plugins", lambda: {})
    for argv in (["bench", "engine", "--help"], ["bench"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert "`baton bench` is not installed" in err and "pip install -e ./bench" in err


def test_a_distribution_adds_a_command_through_its_entry_point(tmp_path, monkeypatch, capsys):
    # An installed distribution as importlib.metadata finds one: a dist-info folder on sys.path.
    (tmp_path / "hello_plugin.py").write_text(
        "def register(sub):\n"
        "    p = sub.add_parser('hello', add_help=False)\n"
        "    p.set_defaults(func=run, passes_unknown_args=True)\n"
        "def run(args):\n"
        "    print('hello', *args.passthrough)\n"
        "    return 7\n"
    )
    info = tmp_path / "hello_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\nhello = hello_plugin:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["hello", "--loud", "x"]) == 7
    assert capsys.readouterr().out == "hello --loud x\n"


def test_a_broken_plugin_leaves_the_other_commands_working(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_plugin.py").write_text("raise ImportError('no such thing (test)')\n")
    info = tmp_path / "broken_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\nbroken = broken_plugin:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["broken", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "`baton broken` cannot run" in err and "no such thing (test)" in err
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0


def test_baton_bench_registers_every_benchmark(monkeypatch):
    from baton.bench.cli import BENCHMARKS, module_of

    ep = EntryPoint(name="bench", value="baton.bench.cli:register", group=PLUGIN_GROUP)
    monkeypatch.setattr(cli_module, "cli_plugins", lambda: {"bench": ep})
    args, unknown = build_parser().parse_known_args(["bench", "masks", "--rows", "1", "-h"])
    assert (args.command, args.benchmark, unknown) == ("bench", "masks", ["--rows", "1", "-h"])
    assert args.passes_unknown_args
    for name in BENCHMARKS:  # each names a module of a family of baton.bench with a main(argv)
        spec = importlib.util.find_spec(module_of(name))
        assert spec is not None and "def main(" in Path(spec.origin).read_text(), name
