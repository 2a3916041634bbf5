"""Rendering shared by the commands: a console that follows the terminal, tables fitted to its
width (:class:`remat_kit.terminal.FittedTable`: headers wrap, then optional columns go, then
cells wrap at spaces; a policy name is never cut), and data escaped so rich never reads it as
markup.

Width: ``COLUMNS`` when set, else the terminal's, else :data:`PIPED_WIDTH` (piped into a file
or a log). ``--json`` output never goes through rich.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from remat_kit.terminal import FittedTable

#: Width of the output written to a file or a pipe when ``COLUMNS`` is not set.
PIPED_WIDTH = 100


def console(**kwargs: Any) -> Console:
    """A console at the terminal's width (``COLUMNS`` first; :data:`PIPED_WIDTH` when not a
    terminal); ``kwargs`` as :class:`rich.console.Console` takes them (``stderr``, ``quiet``)."""
    out = Console(**kwargs)
    if out.is_terminal or "COLUMNS" in os.environ or "width" in kwargs:
        return out
    return Console(width=PIPED_WIDTH, **kwargs)


def text(value: object) -> str:
    """Data as rich markup that prints as itself: ``[seq, seq]``, ``[batch, seq, d_model]`` and
    ``f32[1,8,8192,8192]`` stay intact (:func:`rich.markup.escape`)."""
    return escape(str(value))


def table(
    title: str,
    columns: Sequence[str],
    right: Sequence[str] = (),
    optional: Sequence[str] = (),
    why: str = "--json has them",
) -> Table:
    """A table fitted to the width it is printed at (:func:`remat_kit.terminal.fit_table`):
    cells wrap at word boundaries rather than being cut with an ellipsis; ``right`` names the
    right-justified (numeric) columns, ``optional`` those left out first when the table does
    not fit (the caption names them, and ``why`` where to see them)."""
    t = FittedTable(title=text(title), title_justify="left", optional=optional, why=why)
    for col in columns:
        t.add_column(col, justify="right" if col in right else "left", overflow="fold")
    return t


def add_row(t: Table, *cells: object) -> None:
    """Add a row of data cells, each escaped (see :func:`text`); a :class:`rich.text.Text`
    cell (styled by us) is added as it is."""
    t.add_row(*(c if isinstance(c, Text) else text(c) for c in cells))
