"""Rendering shared by the commands: a console that follows the terminal, tables whose cells
wrap instead of being cut, and data escaped so rich never reads it as markup.

Width: ``COLUMNS`` when set, else the terminal's, else 80 (piped into a file or a log); rich
decides this (:class:`rich.console.Console`). ``--json`` output never goes through rich.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text


def console() -> Console:
    """A console at the terminal's width (``COLUMNS`` first; 80 when not a terminal)."""
    return Console()


def text(value: object) -> str:
    """Data as rich markup that prints as itself: ``[seq, seq]``, ``[batch, seq, d_model]`` and
    ``f32[1,8,8192,8192]`` stay intact (:func:`rich.markup.escape`)."""
    return escape(str(value))


def table(title: str, columns: Sequence[str], right: Sequence[str] = ()) -> Table:
    """A table whose cells wrap at word boundaries (long words fold) rather than being cut with
    an ellipsis; ``right`` names the right-justified (numeric) columns."""
    t = Table(title=text(title), title_justify="left")
    for col in columns:
        t.add_column(col, justify="right" if col in right else "left", overflow="fold")
    return t


def add_row(t: Table, *cells: object) -> None:
    """Add a row of data cells, each escaped (see :func:`text`); a :class:`rich.text.Text`
    cell (styled by us) is added as it is."""
    t.add_row(*(c if isinstance(c, Text) else text(c) for c in cells))
