"""MkDocs hook: Markdown written for the repository's web page and the docs
tests, made right for the site.

* Fences: the docs tests mark a Python block that is shown, not run, as
  ```` ```python no-run ````; pymdownx.superfences does not read `no-run` as an
  option and would render the block as text (its comments as headings). The
  site drops the marker: the block is plain Python there.
* Root files: `docs/benchmarks.md` and `docs/changelog.md` include
  BENCHMARKS.md and CHANGELOG.md with pymdownx.snippets
  (`--8<-- "BENCHMARKS.md"`). Those files are read on the repository's web
  page too, so their links are relative to the root (`docs/how-to/diagnose.md`,
  `README.md`). On the including page, after the snippets are in, their links
  are rewritten to the site's pages (`how-to/diagnose.md`, `index.md`), before
  MkDocs resolves and checks every link (so --strict still catches a broken
  one).

tests/unit/test_docs.py renders the pages with this extension to check their
anchors and fences.
"""

from __future__ import annotations

import posixpath
import re

from markdown import Extension
from markdown.preprocessors import Preprocessor

_INCLUDE = re.compile(r'^--8<-- "[A-Z]+\.md"\s*$', re.M)
_LINK = re.compile(r"\]\((?!#|[a-z]+:)([^)\s]+)\)")
_NO_RUN = re.compile(r"^(?P<fence>[ \t]*(?:`{3,}|~{3,})[ \t]*python)[ \t]+no-run[ \t]*$")
ROOT_PAGES = {"README.md": "index.md", "BENCHMARKS.md": "benchmarks.md",
              "CHANGELOG.md": "changelog.md"}
_page = {"uri": None}  # the page being rendered when it includes a root file


def site_target(target: str, page_uri: str) -> str:
    """A root-relative link target as the site's link from page PAGE_URI."""
    path, hash_, anchor = target.partition("#")
    if path.startswith("docs/"):
        path = path[len("docs/"):]
    elif path in ROOT_PAGES:
        path = ROOT_PAGES[path]
    else:
        return target  # left as it is: MkDocs reports it if it is broken
    return posixpath.relpath(path, posixpath.dirname(page_uri) or ".") + hash_ + anchor


class _RepositoryMarkdown(Preprocessor):
    def __init__(self, md, page_uri=None):
        super().__init__(md)
        self.page_uri = page_uri

    def run(self, lines):
        uri = self.page_uri or _page["uri"]
        out = []
        for line in lines:
            line = _NO_RUN.sub(r"\g<fence>", line)
            if uri is not None:
                line = _LINK.sub(lambda m: f"]({site_target(m.group(1), uri)})", line)
            out.append(line)
        return out


class RepositoryMarkdown(Extension):
    """The preprocessor, after the snippets (32) and before the fences (25)."""

    def __init__(self, page_uri: str | None = None):
        super().__init__()
        self.page_uri = page_uri  # fixed for the tests; else the page being rendered

    def extendMarkdown(self, md):  # noqa: N802  (Markdown's name)
        md.preprocessors.register(_RepositoryMarkdown(md, self.page_uri),
                                  "tfmulti_repository_markdown", 31)


def on_config(config):
    config.markdown_extensions.append(RepositoryMarkdown())
    return config


def on_page_markdown(markdown, page, **kwargs):
    _page["uri"] = page.file.src_uri if _INCLUDE.search(markdown) else None
    return markdown
