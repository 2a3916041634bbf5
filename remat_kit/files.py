"""Writing a file whole or not at all: the one way remat-kit replaces a file another reader may
open (the calibration, the compile cache, the GPU kernel cache, figures, reports, summaries).

The new content is written to a temporary file beside the destination and renamed onto it
(``os.replace``: atomic on one file system, POSIX ``rename(2)``), so a reader sees the old file
or the new one, never a torn one, and a process killed mid-write leaves the old one. The
temporary name is unique per call (process id, thread id and a random part): two threads of one
process writing the same destination at once each rename their own file (a name made from the
process id alone let one thread's rename remove the file the other was about to rename). Files
are created with ``open``, so they get the usual permissions (the umask's), unlike ``mkstemp``'s
owner-only ones.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; when the block ends without an
    exception it is renamed onto ``path`` (folders created as needed), else removed.

    Raises:
      OSError: the folder cannot be made, or the rename fails (the temporary file is removed).
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(
        f".{dest.name}.{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex[:8]}.part"
    )
    try:
        yield part
        os.replace(part, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            part.unlink()
        raise


def write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` whole (see :func:`replacing`)."""
    with replacing(path) as part:
        part.write_text(text, encoding=encoding)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` whole (see :func:`replacing`)."""
    with replacing(path) as part:
        part.write_bytes(data)
