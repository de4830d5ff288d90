"""The documentation is complete in a clone: every link resolves to a file of the repository, and the site builds.

Checked: every relative link and image (Markdown ``[text](target)``, ``![alt](target)``, reference
definitions ``[name]: target``, and HTML ``href``/``src``) in README.md, CONTRIBUTING.md, docs/**/*.md,
benchmarks/RESULTS.md, benchmarks/README.md and examples/README.md. A link must name a file or folder inside the
repository that git does not ignore (so a fresh clone has it); a link may not leave the repository through
``../``. Code blocks are not links and are skipped. Also: every test file the documents cite exists; the
documentation site builds with ``mkdocs build --strict`` (a broken link, heading anchor or docstring fails it)
and its reference pages list every public name of ``seqcal``, ``seqcal.modifiers`` and the command line.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [
    "README.md",
    "CONTRIBUTING.md",
    "benchmarks/RESULTS.md",
    "benchmarks/README.md",
    "examples/README.md",
]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_HTML = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto: ...


def documents() -> list[Path]:
    found = [ROOT / name for name in DOCUMENTS if (ROOT / name).is_file()]
    return found + sorted((ROOT / "docs").rglob("*.md"))


def links(text: str) -> list[str]:
    """Relative link targets of a Markdown text, without fragments; code blocks and spans are not links."""
    prose = _CODE_SPAN.sub("", _FENCE.sub("", text))
    targets = _INLINE.findall(prose) + _REFERENCE.findall(prose) + _HTML.findall(prose)
    relative = [t for t in targets if not _SCHEME.match(t) and not t.startswith("#")]
    return [unquote(t.split("#", 1)[0]) for t in relative]


def problems(doc: Path) -> list[str]:
    """What is wrong with the links of ``doc``: one line per bad link."""
    found = []
    for target in links(doc.read_text(encoding="utf-8")):
        path = (doc.parent / target).resolve()
        where = f"{doc.relative_to(ROOT)}: link {target!r}"
        if not path.is_relative_to(ROOT):
            found.append(f"{where} leaves the repository ({path}); link a file inside it")
        elif not path.exists():
            found.append(f"{where} points to {path.relative_to(ROOT)}, which does not exist")
        elif _ignored(path):
            found.append(f"{where} points to {path.relative_to(ROOT)}, which git ignores (a clone lacks it)")
    return found


def _ignored(path: Path) -> bool:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return False  # not a git checkout (e.g. an unpacked sdist): existence is all that can be checked
    proc = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT, capture_output=True)
    return proc.returncode == 0


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_inside_the_repository(doc: Path) -> None:
    assert problems(doc) == []


def test_the_documents_are_there() -> None:
    names = {str(p.relative_to(ROOT)) for p in documents()}
    assert {"README.md", "CONTRIBUTING.md", "docs/design.md", "examples/README.md"} <= names


def test_link_checker_catches_what_it_should(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The checker itself can fail: a missing file, a link out through ../, an image, a reference link.
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "pic.png").write_bytes(b"")
    (tmp_path / "README.md").write_text("ok\n")
    doc = tmp_path / "docs" / "x.md"
    doc.write_text(
        "[good](../README.md#top) ![img](pic.png) [web](https://example.org) [here](#section)\n"
        "[gone](missing.md) ![lost](img/none.svg) [out](../../shared/DESIGN.md)\n"
        '[ref]: nowhere.md\n<img src="also-missing.png">\n'
        "```\n[in code](not-a-link.md)\n```\n`[span](nor-this.md)`\n"
    )
    found = "\n".join(problems(doc))
    for bad in ("missing.md", "img/none.svg", "nowhere.md", "also-missing.png"):
        assert f"link {bad!r}" in found and "does not exist" in found
    assert "'../../shared/DESIGN.md' leaves the repository" in found
    assert "not-a-link" not in found and "nor-this" not in found
    assert len(found.splitlines()) == 5


def test_cited_test_files_exist() -> None:
    cited = set()
    for doc in documents():
        cited |= set(re.findall(r"\btests/[\w/]+\.py\b", doc.read_text(encoding="utf-8")))
    missing = sorted(name for name in cited if not (ROOT / name).is_file())
    assert cited and missing == []


def test_eval_help_says_what_is_measured_without_wikitext() -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "seqcal.cli", "eval", "ppl", "--help"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "calibration text embedded in seqcal" in text
    assert "understates the quantization loss and is not comparable with published WikiText-2 numbers" in text


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_venv_passes_torch_index_url_only_when_given(tmp_path: Path) -> None:
    # `make -n` prints the install commands without running them; VENV points away from the real .venv.
    def torch_line(*extra: str) -> str:
        proc = subprocess.run(["make", "-n", "venv", f"VENV={tmp_path / 'venv'}", *extra], cwd=ROOT,
                              capture_output=True, text=True, check=True)  # fmt: skip
        return next(line for line in proc.stdout.splitlines() if "pip install torch" in line)

    assert "--index-url" not in torch_line()  # the default reaches PyPI only
    cpu = "https://download.pytorch.org/whl/cpu"
    assert torch_line(f"TORCH_INDEX_URL={cpu}").split()[-2:] == ["--index-url", cpu]


INTERNAL = re.compile(r"\bsessions?\b|\blent\b|\$OUT\b|device tool|device call|\bissue \d+", re.I)


@pytest.mark.parametrize("name", DOCUMENTS)
def test_documents_speak_to_outside_readers(name: str) -> None:
    # Words of the team's own workflow (work sessions, borrowed machines, tracker numbers) mean nothing
    # to a reader of a clone; say what was measured and how instead.
    lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
    found = [f"{name}:{i}: {line.strip()}" for i, line in enumerate(lines, 1) if INTERNAL.search(line)]
    assert found == []


# ------------------------------------------------------------------------ the documentation site (mkdocs.yml)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built as `make docs` builds it (strict: any warning fails), into a temporary folder."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    out = tmp_path_factory.mktemp("site")
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("mkdocs").addHandler(handler)
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        build(load_config(str(ROOT / "mkdocs.yml"), site_dir=str(out), strict=True))
    except Abort as abort:
        pytest.fail(f"mkdocs build --strict: {abort}\n" + "\n".join(warnings))
    finally:
        os.chdir(cwd)
        logging.getLogger("mkdocs").removeHandler(handler)
    return out


def _ids(page: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', page.read_text(encoding="utf-8")))


def test_api_reference_lists_every_public_name(site: Path) -> None:
    import seqcal
    import seqcal.modifiers

    ids = _ids(site / "reference/api/index.html")
    assert {f"seqcal.{name}" for name in seqcal.__all__} - ids == set()
    ids = _ids(site / "reference/modifiers/index.html")
    assert {f"seqcal.modifiers.{name}" for name in seqcal.modifiers.__all__} - ids == set()


def test_cli_reference_lists_every_subcommand_and_argument(site: Path) -> None:
    import argparse

    from seqcal.cli import build_parser

    text = (site / "reference/cli/index.html").read_text(encoding="utf-8")

    def walk(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.ArgumentParser]]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += [(f"{path} {name}", sub), *walk(sub, f"{path} {name}")]
        return found

    commands = walk(build_parser(), "seqcal")
    assert {"seqcal oneshot", "seqcal plan", "seqcal trace", "seqcal eval ppl"} <= {c for c, _ in commands}
    for command, parser in commands:
        assert f"<code>{command}</code>" in text, command
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue  # every command has -h
            for option in action.option_strings:
                assert f"<code>{option}</code>" in text, f"{command} {option}"


def test_site_has_the_pages_a_newcomer_needs(site: Path) -> None:
    pages = ["install", "quantize", "recipes", "schemes", "algorithms", "multimodal", "moe", "distributed",
             "memory", "tracing", "report", "evaluate", "modifiers", "design", "reference/recipes", "gguf",
             "sources", "model-free", "reference/contract"]  # fmt: skip
    assert [p for p in pages if not (site / p / "index.html").is_file()] == []
    # the repository files the pages link are in the site, with RESULTS.md as a page
    assert (site / "repo/benchmarks/RESULTS/index.html").is_file()
    assert (site / "repo/examples/custom_modifier.py").is_file()


def test_repository_links_point_at_the_site_copy() -> None:
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        from repo_links import RepoLinks, _targets
    finally:
        sys.path.remove(str(ROOT / "docs" / "hooks"))
    text = "[a](../examples/x.py#l) [b](memory.md#set) [web](https://x.org)\n```\n[c](../nope.md)\n```\n`[d](../y)`"
    assert _targets(text) == ["../examples/x.py", "memory.md"]
    links = RepoLinks(str(ROOT / "docs"))
    assert links.site_uri(ROOT / "examples" / "x.py") == "repo/examples/x.py"
    assert links.site_uri(ROOT / "recipes") == "repo/recipes/index.md"
    assert links.site_uri(ROOT / "docs" / "memory.md") == "memory.md"
    assert links.site_uri(ROOT.parent / "elsewhere.md") is None


def test_strict_build_fails_on_a_missing_repository_file(tmp_path: Path) -> None:
    # The site's own validation, on a two-page project with the same hook: a link to a repository file that
    # does not exist, or to a heading a page lacks, aborts the strict build and names the link.
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    (tmp_path / "docs").mkdir()
    (tmp_path / "there.py").write_text("x = 1\n")
    (tmp_path / "docs" / "index.md").write_text(
        "# Home\n\n[ok](../there.py) [gone](../missing.py) [p](p.md#nope)\n"
    )
    (tmp_path / "docs" / "p.md").write_text("# Page\n")
    (tmp_path / "mkdocs.yml").write_text(
        f"site_name: t\nhooks: [{ROOT / 'docs' / 'hooks' / 'repo_links.py'}]\n"
        "validation: {omitted_files: warn, absolute_links: warn, unrecognized_links: warn, anchors: warn}\n"
    )
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("mkdocs").addHandler(handler)
    try:
        with pytest.raises(Abort):
            build(load_config(str(tmp_path / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True))
    finally:
        logging.getLogger("mkdocs").removeHandler(handler)
    text = "\n".join(messages)
    assert "repo/missing.py" in text and "#nope" in text and "there.py" not in text
    assert (tmp_path / "site" / "repo" / "there.py").is_file()
