"""mkdocs hook: Sphinx roles in the docstrings (``:func:`name```, ``:class:`~pkg.Name```), which
mkdocstrings renders literally as ``:func:<code>name</code>``, shown as the code name alone
(``~`` keeps the last component, as in Sphinx). tests/test_doctests.py checks that the names
resolve."""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):<code>(~?)([^<]+)</code>")


def _name(match: re.Match[str]) -> str:
    tilde, name = match.groups()
    return f"<code>{name.rsplit('.', 1)[-1] if tilde else name}</code>"


def on_page_content(html: str, **kwargs) -> str:
    return ROLE.sub(_name, html)
