"""MkDocs hooks for the tinyscale site (registered under `hooks:` in mkdocs.yml).

The site is `docs/` plus the repository's top-level `lessons/` folder. MkDocs has one
docs_dir, so this hook:

1. adds every file under `lessons/` (pages, figures) to the build at the URL prefix
   `lessons/`, read from where it lives; `watch: [lessons, src]` in mkdocs.yml makes
   `mkdocs serve` rebuild when a lesson or an included source file changes;
2. rewrites links written for the repository (`../docs/api.md` in a lesson) into links
   that resolve on the site (`../api.md`), so one link works in both places;
3. stops the build when the vendored Mermaid/KaTeX/iframe-worker files are missing (run
   `scripts/fetch_site_assets.sh`), since material would silently fall back to a CDN;
4. fails any page that references an external script or stylesheet: the site must
   work offline;
5. lets a long inline code span in a table cell (a test's node id, a source path) wrap
   after its separators (`/`, `::`, `_`, `.`, `,`): table code otherwise stays on one line
   (docs/stylesheets/extra.css), and one 90-character node id made every question-bank
   table wider than the text column.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

LESSONS_DIR = "lessons"

# Files the site loads from docs/assets/vendor/ (see scripts/fetch_site_assets.sh).
VENDORED = (
    "assets/vendor/mermaid/mermaid.min.js",
    "assets/vendor/katex/katex.min.js",
    "assets/vendor/katex/katex.min.css",
    "assets/vendor/katex/contrib/auto-render.min.js",
    "assets/vendor/iframe-worker/shim.js",
)

_SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints"}

# `](../docs/x.md` or `]: ../docs/x.md` in a lesson -> `](../x.md`: on the site the
# lessons sit one level below the pages of docs/.
_REPO_DOCS_LINK = re.compile(r"(\]\(\s*<?|\]:[ \t]*<?)\.\./docs/")

# Fenced code blocks and inline code spans: examples there are shown as written.
_CODE = re.compile(r"(?ms)^[ \t]*(?P<fence>`{3,}|~{3,}).*?^[ \t]*(?P=fence)[`~]*[ \t]*$|(?P<ticks>`+).+?(?P=ticks)")

_EXTERNAL_ASSET = re.compile(
    r"<script\b[^>]*\bsrc=[\"']?(?:https?:)?//[^\"'\s>]+"
    r"|<link\b(?=[^>]*\brel=[\"']?stylesheet)[^>]*\bhref=[\"']?(?:https?:)?//[^\"'\s>]+",
    re.IGNORECASE,
)


# A table cell, and in it an inline code span with no markup inside, at least LONG_CODE long.
_TABLE_CELL = re.compile(r"(?s)<td\b[^>]*>.*?</td>")
LONG_CODE = 32
_LONG_CODE = re.compile(r"<code>([^<]{%d,})</code>" % LONG_CODE)
_BREAK_AFTER = re.compile(r"(::|[/_.,])")


def _breakable(cell: re.Match) -> str:
    return _LONG_CODE.sub(
        lambda m: '<code class="ts-wrap">' + _BREAK_AFTER.sub(r"\1<wbr>", m.group(1)) + "</code>", cell.group(0)
    )


def _repo_root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    docs_dir = Path(config.docs_dir)
    missing = [p for p in VENDORED if not (docs_dir / p).is_file()]
    if missing:
        raise PluginError(
            "offline site assets are missing: "
            + ", ".join(missing)
            + ". Run `bash scripts/fetch_site_assets.sh` first (or `make docs`)."
        )
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = _repo_root(config)
    lessons = root / LESSONS_DIR
    if not lessons.is_dir():
        return files
    for path in sorted(lessons.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or any(p.startswith(".") or p in _SKIP_PARTS for p in rel.parts):
            continue
        src_uri = rel.as_posix()  # "lessons/00-setup.md": also its place on the site
        if files.get_file_from_path(src_uri) is not None:
            raise PluginError(f"{src_uri} exists both in docs/ and in the top-level lessons/")
        files.append(
            File(
                src_uri,
                src_dir=str(root),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files


def _rewrite_repo_links(markdown: str) -> str:
    out, pos = [], 0
    for code in _CODE.finditer(markdown):
        out.append(_REPO_DOCS_LINK.sub(r"\1../", markdown[pos : code.start()]))
        out.append(code.group(0))
        pos = code.end()
    out.append(_REPO_DOCS_LINK.sub(r"\1../", markdown[pos:]))
    return "".join(out)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri.startswith(LESSONS_DIR + "/"):
        markdown = _rewrite_repo_links(markdown)
    return markdown


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    return _TABLE_CELL.sub(_breakable, html)


def on_post_page(output: str, page: Page, config: MkDocsConfig) -> str:
    found = _EXTERNAL_ASSET.search(output)
    if found:
        raise PluginError(
            f"{page.file.src_uri} loads an external asset ({found.group(0)}...); "
            "the site must work offline: vendor it under docs/assets/vendor/."
        )
    return output
