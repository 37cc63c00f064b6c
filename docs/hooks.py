"""MkDocs hooks: the README is the site's home page, the CLI reference (docs/cli.md, committed so
the repository page has it) must be what the commands generate, and every repository path a page
names in backticks must exist (a strict build fails on a stale reference or a missing path, as
it does on a missing page or anchor)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.plait")
ROOT = Path(__file__).resolve().parent.parent
REPO_PATH = re.compile(r"`((?:src|bench|data|examples|tests|docs|\.ci)/[^`\s]*)`")


def on_files(files: Files, config: Any) -> Files:
    readme = (ROOT / "README.md").read_text()
    readme = re.sub(r"\]\(docs/", "](", readme)  # the README links docs/ from the top
    files.append(File.generated(config, "index.md", content=readme))

    from plait.cli.main import app
    from plait.cli.reference import markdown_reference

    if (ROOT / "docs" / "cli.md").read_text().rstrip() != markdown_reference(app).rstrip():
        log.warning("docs/cli.md is not what the commands generate: run "
                    "`python -m plait.cli.reference > docs/cli.md`")
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    for path in REPO_PATH.findall(markdown):
        path = path.rstrip(".,;:)")
        found = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
        if not found:
            log.warning(f"{page.file.src_uri}: names `{path}`, which does not exist in the "
                        "repository")
    return markdown
