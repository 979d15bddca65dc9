"""MkDocs hook: pages that include a file of the repository's root.

`docs/benchmarks.md` and `docs/changelog.md` include BENCHMARKS.md and
CHANGELOG.md with pymdownx.snippets (`--8<-- "BENCHMARKS.md"`). Those files
are read on the repository's web page too, so their links are relative to the
root (`docs/how-to/diagnose.md`, `README.md`). On the including page, after
the snippets are in, this hook rewrites them to the site's pages
(`how-to/diagnose.md`, `index.md`), before MkDocs resolves and checks every
link (so --strict still catches a broken one).
"""

from __future__ import annotations

import posixpath
import re

from markdown import Extension
from markdown.preprocessors import Preprocessor

_INCLUDE = re.compile(r'^--8<-- "[A-Z]+\.md"\s*$', re.M)
_LINK = re.compile(r"\]\((?!#|[a-z]+:)([^)\s]+)\)")
ROOT_PAGES = {"README.md": "index.md", "BENCHMARKS.md": "benchmarks.md",
              "CHANGELOG.md": "changelog.md"}
_page = {"uri": None}  # the page being rendered, set by on_page_markdown


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


class _RootLinks(Preprocessor):
    def run(self, lines):
        uri = _page["uri"]
        if uri is None:
            return lines
        return [_LINK.sub(lambda m: f"]({site_target(m.group(1), uri)})", line)
                for line in lines]


class _RootLinksExtension(Extension):
    def extendMarkdown(self, md):  # noqa: N802  (Markdown's name)
        md.preprocessors.register(_RootLinks(md), "tfmulti_root_links", 31)  # after snippets (32)


def on_config(config):
    config.markdown_extensions.append(_RootLinksExtension())
    return config


def on_page_markdown(markdown, page, **kwargs):
    _page["uri"] = page.file.src_uri if _INCLUDE.search(markdown) else None
    return markdown
