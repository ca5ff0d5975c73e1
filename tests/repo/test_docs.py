"""README.md stays a page and the docs/ pages hold together: a short README with its two
commands, no dead relative link, no repository path in backticks that the repository lacks,
and README examples that compile, import, and ask the server for the same constraint."""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import ROOT

README = ROOT / "README.md"
MAX_README_LINES = 250
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), an optional "title" after the target.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_PATH_LIKE = re.compile(r"^[\w.\-/]+$")
_PATH_ENDINGS = (".py", ".md", ".json", ".png", "/")
_TWO_COMMANDS = (
    "```sh\n"
    "make demo    # the default model (SmolLM2-135M-Instruct) extracts a person from a sentence"
    " as schema-valid JSON\n"
    "make test    # the test suite (ruff + pytest, CPU only)\n"
    "```"
)


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (lines kept, so line numbers still count)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _code_blocks(text: str, language: str) -> list[str]:
    return [m.group(2) for m in _FENCE.finditer(text) if m.group(1) == language]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {
        _slug(line.lstrip("#"))
        for line in _prose(page.read_text()).splitlines()
        if line.startswith("#")
    }


def dead_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``page`` whose file (or heading anchor in a Markdown file) does
    not exist, as ``page:line: target`` (``page`` relative to ``root``)."""
    dead = []
    for number, line in enumerate(_prose(page.read_text()).splitlines(), 1):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page
            ok = path.exists()
            if ok and anchor and path.suffix == ".md":
                ok = anchor in _anchors(path)
            if not ok:
                dead.append(f"{page.relative_to(root)}:{number}: {target}")
    return dead


def missing_paths(page: Path, root: Path = ROOT) -> list[str]:
    """Repository paths written in backticks in ``page``'s prose (a ``/`` in them and a
    ``.py``/``.md``/``.json``/``.png`` ending or a trailing ``/``; globs, ``~`` and absolute
    paths are not repository paths) that do not exist under ``root``, as ``page:line: path``."""
    missing = []
    for number, line in enumerate(_prose(page.read_text()).splitlines(), 1):
        for code in _INLINE_CODE.findall(line):
            token = code.strip("`")
            if "/" not in token or not _PATH_LIKE.match(token) or token.startswith("/"):
                continue
            if token.endswith(_PATH_ENDINGS) and not (root / token).exists():
                missing.append(f"{page.relative_to(root)}:{number}: {token}")
    return missing


def test_readme_is_a_page() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_the_readme_keeps_the_two_commands() -> None:
    # .ci/run and the Makefile run the README's test command: it must stay what they run.
    assert _TWO_COMMANDS in README.read_text()
    assert "\nmake test\n" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(page: Path) -> None:
    assert dead_links(page) == []


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_name_only_paths_that_exist(page: Path) -> None:
    assert missing_paths(page) == []


def test_the_checks_catch_a_dead_link_and_a_missing_path(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A page\n\n## Two words, one comma\n")
    page = docs / "b.md"
    page.write_text(
        "see [a](a.md), [a's part](a.md#two-words-one-comma), [web](https://example.com),\n"
        "[gone](missing.md), [bad part](a.md#nowhere), `[x](nolink.md)` in code\n"
        "```sh\ncat [y](fenced.md)\n```\n"
    )
    assert dead_links(page, tmp_path) == ["docs/b.md:2: missing.md", "docs/b.md:2: a.md#nowhere"]
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "config.py").write_text("")
    readme = tmp_path / "README.md"
    readme.write_text(
        "`engine/config.py`, `engine/`, `bench/results/*.json`, `~/.cache/x.json`,\n"
        "`engine/nowhere.py`, `grammar/`\n"
    )
    assert missing_paths(readme, tmp_path) == [
        "README.md:2: engine/nowhere.py",
        "README.md:2: grammar/",
    ]


def test_the_readme_python_examples_compile_and_import() -> None:
    blocks = _code_blocks(README.read_text(), "python")
    assert blocks, "the README has a Python example"
    for source in blocks:
        tree = ast.parse(compile(source, "README.md", "exec", ast.PyCF_ONLY_AST))
        # The imports are cheap (no model): run them, so a renamed export fails here.
        imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        exec(compile(ast.Module(body=imports, type_ignores=[]), "README.md", "exec"), {})


def test_the_http_example_asks_for_the_python_examples_constraint() -> None:
    from baton.engine.server.constraints import request_constraint
    from baton.engine.server.protocol import ChatCompletionRequest

    text = README.read_text()
    (python,) = _code_blocks(text, "python")
    names = {
        n.targets[0].id: n.value
        for n in ast.parse(python).body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
    }
    schema, prompt = ast.literal_eval(names["schema"]), ast.literal_eval(names["prompt"])
    curls = [b for b in _code_blocks(text, "sh") if b.startswith("curl ")]
    assert len(curls) == 1, "the README has one curl example"
    words = shlex.split(curls[0])
    assert "localhost:8000/v1/chat/completions" in words
    body = json.loads(words[words.index("-d") + 1])
    constraint = request_constraint(ChatCompletionRequest.model_validate(body), "auto")
    assert constraint is not None and constraint.param == "response_format"
    assert constraint.spec.json == schema
    assert body["messages"] == [{"role": "user", "content": prompt}]
