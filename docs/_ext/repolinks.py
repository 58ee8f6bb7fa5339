"""Links from the documentation to files of the repository outside ``docs/``.

The pages link to results, examples and tools with relative paths
(``../results/h200x2/session7/README.md``), which read correctly where the Markdown is
read as it is (a repository browser).  Sphinx knows only the files under ``docs/``: MyST
turns such a link into a download of nothing, or into a reference it cannot resolve.
This transform runs before MyST's resolver and turns every relative link whose target
exists in the repository into a link to it: under ``hoccl_repo_url`` when that is set
(``HOCCL_DOCS_REPO_URL``, e.g. a repository browser's ``.../blob/main``), else a path
relative to the built page, which opens the checkout's file from a local build.  A link
whose target does not exist is left alone, so the build reports it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms.post_transforms import SphinxPostTransform


def _repository_path(app: Sphinx, docname: str, target: str) -> Optional[Path]:
    """The existing repository file or folder a page's relative link names, or None."""
    if not target or "://" in target or target.startswith(("#", "/", "mailto:")):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    srcdir = Path(app.srcdir).resolve()
    root = srcdir.parent
    resolved = (srcdir / os.path.dirname(docname) / path).resolve()
    if resolved.is_relative_to(srcdir) or not resolved.is_relative_to(root):
        return None
    return resolved if resolved.exists() else None


class RepositoryLinks(SphinxPostTransform):
    default_priority = 5  # before MyST's reference resolver (9)

    def run(self, **kwargs: Any) -> None:
        app = self.app
        docname = self.env.docname
        root = Path(app.srcdir).resolve().parent
        base_url = app.config.hoccl_repo_url.rstrip("/")
        for node in list(self.document.findall(addnodes.pending_xref)) + list(
                self.document.findall(addnodes.download_reference)):
            if node.get("reftype") != "myst":
                continue
            target = node.get("reftarget", "")
            if node.get("refdomain") == "doc" and os.path.isabs(target):
                # MyST names an existing Markdown file by its absolute path without suffix
                target = os.path.relpath(target, Path(app.srcdir) / os.path.dirname(docname))
                target += next((suffix for suffix in app.config.source_suffix
                                if os.path.exists(node["reftarget"] + suffix)), "")
            path = _repository_path(app, docname, target)
            if path is None:
                continue
            relative = path.relative_to(root).as_posix() + ("/" if path.is_dir() else "")
            if base_url:
                uri = f"{base_url}/{relative}"
            else:
                page_dir = Path(app.outdir).resolve() / os.path.dirname(docname)
                uri = os.path.relpath(root / relative, page_dir) + ("/" if path.is_dir() else "")
            reference = nodes.reference("", "", internal=False, refuri=uri)
            reference += node.children
            node.replace_self(reference)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value("hoccl_repo_url", os.environ.get("HOCCL_DOCS_REPO_URL", ""), "html")
    app.add_post_transform(RepositoryLinks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
