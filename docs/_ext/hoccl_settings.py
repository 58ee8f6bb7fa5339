"""``{hoccl-environment}``: the table of every environment variable hoccl reads, made
from ``hoccl.config.ENVIRONMENT`` (the one list of them), so the page cannot drift from
the code."""

from __future__ import annotations

from typing import Any, List

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


class EnvironmentTable(SphinxDirective):
    has_content = False

    def run(self) -> List[nodes.Node]:
        from hoccl.config import ENVIRONMENT
        table = nodes.table()
        group = nodes.tgroup(cols=2)
        table += group
        group += nodes.colspec(colwidth=30)
        group += nodes.colspec(colwidth=70)
        head = nodes.thead()
        group += head
        head += self._row("variable", "what it does")
        body = nodes.tbody()
        group += body
        for name in sorted(ENVIRONMENT):
            body += self._row(name, ENVIRONMENT[name], literal=True)
        return [table]

    @staticmethod
    def _row(first: str, second: str, literal: bool = False) -> nodes.row:
        row = nodes.row()
        for index, text in enumerate((first, second)):
            entry = nodes.entry()
            paragraph = nodes.paragraph()
            paragraph += nodes.literal(text=text) if literal and index == 0 else nodes.Text(text)
            entry += paragraph
            row += entry
        return row


def setup(app: Sphinx) -> Any:
    app.add_directive("hoccl-environment", EnvironmentTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
