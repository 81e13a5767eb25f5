"""MkDocs hook (mkdocs.yml `hooks:`): links from a docs page to a file of the repository outside docs/.

The pages link to examples, tests and source files with relative paths (`../examples/envs/mcp_agent.py`), which work
where the repository is browsed (GitHub, an editor). MkDocs only knows the files under docs/ and would report each as
not found. This hook checks that the target exists (a missing one fails the build, as a broken docs link does in
strict mode) and then points the link at `repo_url` when mkdocs.yml sets one, or keeps its text alone otherwise.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError


LINK = re.compile(r"(?<!!)\[([^\]\n]*)\]\(([^)\s]+)\)")  # [text](target), not images
EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|#|/)")  # a scheme (https:, mailto:), an anchor, an absolute path


def on_page_markdown(markdown, page, config, files):
    docs = Path(config.docs_dir).resolve()
    repo = docs.parent  # mkdocs.yml sits at the repository root, over docs/
    folder = (docs / page.file.src_path).parent

    def outside_docs(match: re.Match) -> str:
        text, url = match.groups()
        if EXTERNAL.match(url):
            return match.group(0)
        path, _, anchor = url.partition("#")
        target = (folder / path).resolve()
        if target.is_relative_to(docs):
            return match.group(0)  # a page or image of the site: MkDocs validates it
        if not target.is_relative_to(repo) or not target.exists():
            raise PluginError(
                f"Doc file '{page.file.src_path}' links to '{url}', which is not a file of the repository "
                f"({target}). Fix the path or remove the link."
            )
        if not config.repo_url:
            return text
        kind = "tree" if target.is_dir() else "blob"
        return f"[{text}]({config.repo_url.rstrip('/')}/{kind}/main/{target.relative_to(repo).as_posix()}" + (
            f"#{anchor})" if anchor else ")"
        )

    # Links in prose only: fenced code blocks are left as written.
    parts = re.split(r"(^```.*?^```)", markdown, flags=re.M | re.S)
    return "".join(part if part.startswith("```") else LINK.sub(outside_docs, part) for part in parts)
