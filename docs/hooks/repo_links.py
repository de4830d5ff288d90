"""Links from the documentation to files of the repository outside docs/ (examples, recipes, RESULTS.md).

The pages link repository files as a clone has them (``../examples/custom_modifier.py``), so the links work on
GitHub and in an editor. mkdocs only knows the files under docs/, so this hook adds every repository file the
pages link (and, for linked Markdown files such as benchmarks/RESULTS.md, the files those link in turn) to the
site under ``repo/<path>``, and rewrites each link to that copy. A linked folder gets a generated page listing
its files. A link to a file the repository does not have is rewritten all the same, so ``mkdocs build --strict``
fails on it, naming the page and the link.
"""

from __future__ import annotations

import posixpath
import re
import subprocess
from pathlib import Path

from mkdocs.structure.files import File, Files

PREFIX = "repo"
# Code blocks and spans are left as they are; the other group is a Markdown link target: `](target)`.
_PARTS = re.compile(
    r"(?P<code>^(```|~~~).*?^\2|`[^`\n]*`)|(?P<open>\]\(\s*<?)(?P<target>[^)\s>]+)", re.S | re.M
)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _tracked(repo: Path) -> set[str] | None:
    """Paths git tracks or would track (not ignored), or None outside a git checkout (existence decides)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=repo,
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return set(out.splitlines())


def _targets(text: str) -> list[str]:
    """Relative link targets of a Markdown text (no fragment), outside code."""
    found = []
    for match in _PARTS.finditer(text):
        target = match.group("target")
        if target and not _SCHEME.match(target) and not target.startswith("#"):
            found.append(target.split("#", 1)[0])
    return [t for t in found if t]


class RepoLinks:
    """Where a page's links point in the repository, and where that is on the site."""

    def __init__(self, docs_dir: str) -> None:
        self.docs = Path(docs_dir).resolve()
        self.repo = self.docs.parent
        self.tracked = _tracked(self.repo)

    def source(self, src_uri: str) -> Path:
        """The repository file a site page comes from."""
        if src_uri.startswith(PREFIX + "/"):
            return self.repo / src_uri[len(PREFIX) + 1 :]
        return self.docs / src_uri

    def site_uri(self, path: Path) -> str | None:
        """The site path of a repository path; None outside the repository."""
        if path.is_relative_to(self.docs):
            return path.relative_to(self.docs).as_posix()
        if not path.is_relative_to(self.repo):
            return None
        rel = path.relative_to(self.repo).as_posix()
        return f"{PREFIX}/{rel}/index.md" if path.is_dir() else f"{PREFIX}/{rel}"

    def listed(self, rel: str) -> bool:
        return (self.repo / rel).exists() if self.tracked is None else rel in self.tracked

    def folder_files(self, folder: Path) -> list[str]:
        """The files a folder holds directly (those git does not ignore), by name."""
        return sorted(p.name for p in folder.iterdir() if p.is_file() and self.listed(self.rel(p)))

    def rel(self, path: Path) -> str:
        return path.relative_to(self.repo).as_posix()


def _nav_uris(nav: list | dict | str) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    items = nav.values() if isinstance(nav, dict) else nav
    return [uri for item in items for uri in _nav_uris(item)]


def _folder_page(links: RepoLinks, folder: Path) -> str:
    rel = links.rel(folder)
    lines = [f"# `{rel}/`", "", f"The files of `{rel}/` in the repository:", ""]
    lines += [f"- [{name}]({name})" for name in links.folder_files(folder)]
    return "\n".join(lines) + "\n"


def on_files(files: Files, config) -> Files:
    """Add the repository files the pages link, transitively through linked Markdown files and folders."""
    links = RepoLinks(config["docs_dir"])
    pending = [links.source(f.src_uri) for f in files.documentation_pages()]
    added: set[str] = set()
    for uri in _nav_uris(config["nav"] or []):  # a repository file the navigation names (RESULTS.md)
        if uri.startswith(PREFIX + "/") and (path := links.source(uri)).is_file():
            added.add(uri)
            files.append(File.generated(config, uri, abs_src_path=str(path)))
            pending.append(path)
    while pending:
        page = pending.pop()
        for target in _targets(page.read_text(encoding="utf-8")):
            path = (page.parent / target).resolve()
            uri = links.site_uri(path)
            if (
                uri is None
                or not uri.startswith(PREFIX + "/")
                or uri in added
                or files.get_file_from_path(uri)
            ):
                continue
            if path.is_dir():
                added.add(uri)
                files.append(File.generated(config, uri, content=_folder_page(links, path)))
                pending += [path / name for name in links.folder_files(path) if name.endswith(".md")]
                for name in links.folder_files(path):
                    sub = f"{PREFIX}/{links.rel(path / name)}"
                    if sub not in added and not files.get_file_from_path(sub):
                        added.add(sub)
                        files.append(File.generated(config, sub, abs_src_path=str(path / name)))
            elif path.is_file() and links.listed(links.rel(path)):
                added.add(uri)
                files.append(File.generated(config, uri, abs_src_path=str(path)))
                if path.suffix == ".md":
                    pending.append(path)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Point every link that leaves docs/ at the site's copy of the repository file."""
    links = RepoLinks(config["docs_dir"])
    here = links.source(page.file.src_uri)
    page_dir = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        target = match.group("target")
        if target is None or _SCHEME.match(target) or target.startswith("#"):
            return match.group(0)
        path_part, _, fragment = target.partition("#")
        uri = links.site_uri((here.parent / path_part).resolve())
        if uri is None:
            return match.group(0)  # leaves the repository: mkdocs reports it
        new = posixpath.relpath(uri, page_dir or ".") + (f"#{fragment}" if fragment else "")
        return match.group("open") + new

    return _PARTS.sub(rewrite, markdown)
