"""A persistent on-disk cache of compiles: a repeated analysis reads it instead of compiling.

It keeps a compile's artifacts (optimized HLO, dumps, ``memory_analysis()`` fields, log lines,
seconds), read back as a fresh compile is; :class:`CachedExecutable` cannot run. Key:
:meth:`CompileCache.key`. One gzip JSON file per compile in :func:`default_folder`; off with
``REMAT_KIT_NO_CACHE=1``; LRU within ``$REMAT_KIT_CACHE_MAX_BYTES`` (default
:data:`DEFAULT_MAX_BYTES`). Key parts and settings: docs/performance.md ("The compile cache").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import time
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from remat_kit import files
from remat_kit import targets as T
from remat_kit.memory import hlo
from remat_kit.memory.xla_compile import CompileResult, LogLine, count_xla_remat
from remat_kit.units import parse_bytes

#: Raised whenever what an entry holds, or how it is read back, changes.
FORMAT_VERSION = 1
ENV_DIR = "REMAT_KIT_CACHE_DIR"
ENV_OFF = "REMAT_KIT_NO_CACHE"
ENV_MAX_BYTES = "REMAT_KIT_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 * 2**30
#: Where XLA's GPU kernel cache is kept between runs, when not in the compile cache's folder.
ENV_KERNELS = "REMAT_KIT_KERNEL_CACHE_DIR"
#: The largest kernel-cache file written back (a larger one stays with its run).
KERNEL_CACHE_MAX_BYTES = 256 * 2**20
#: Compiler options that name a place on disk and do not change what XLA produces.
_PATH_OPTIONS = ("xla_dump_to", "xla_gpu_kernel_cache_file")
#: Distributions whose versions decide the compiler (those installed).
_DISTRIBUTIONS = (
    "jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
    "jax-cuda13-pjrt", "libtpu", "libtpu-nightly",
)  # fmt: skip
_ENV_KEYS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
_SUFFIX = ".json.gz"
#: An MLIR location alias definition: ``#loc12 = loc("jit(f)/dot"(#loc3))``.
_LOC_DEF = re.compile(r"^#(loc\d*) = loc\((.*)\)[ \t]*(?:\n|$)", re.M)
#: A quoted MLIR string at the start of a location body.
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _loc_name(body: str, aliases: Mapping[str, str], depth: int = 0) -> str:
    """A location body's NameLoc (``"jit(f)/dot"(...)`` -> ``jit(f)/dot``, aliases resolved);
    "" for anything else (file positions, call sites: no reader uses them)."""
    body = body.strip()
    if body.startswith("#loc") and depth < 64:
        return _loc_name(aliases.get(body[1:], ""), aliases, depth + 1)
    m = _QUOTED.match(body)
    if m and (body[m.end() :].startswith("(") or m.end() == len(body)):
        return m.group(1)
    return ""


def canonical_locations(text: str) -> str:
    """StableHLO ``text`` with each ``loc(...)`` written ``loc["name"]`` and alias definitions
    dropped: one program traced from anywhere reads the same; op names still differ."""
    aliases = {name: body for name, body in _LOC_DEF.findall(text)}
    body = _LOC_DEF.sub("", text)
    out, i = [], 0
    while (j := body.find("loc(", i)) >= 0:
        out.append(body[i:j])
        if j and (body[j - 1].isalnum() or body[j - 1] in "_.$-@"):  # "@alloc(": not a location
            out.append("loc(")
            i = j + 4
            continue
        depth, k, quoted = 0, j + 3, False
        while k < len(body):  # the balanced parentheses of loc(...), strings skipped
            c = body[k]
            if quoted:
                if c == "\\":
                    k += 1
                elif c == '"':
                    quoted = False
            elif c == '"':
                quoted = True
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        out.append(f'loc["{_loc_name(body[j + 4 : k], aliases)}"]')
        i = k + 1
    out.append(body[i:])
    return "".join(out)


def default_folder() -> Path:
    """``$REMAT_KIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/remat-kit``, else
    ``~/.cache/remat-kit``."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "remat-kit"


def enabled() -> bool:
    """False when ``REMAT_KIT_NO_CACHE`` is set to anything but ``""`` / ``0``."""
    return os.environ.get(ENV_OFF, "") in ("", "0")


@functools.cache
def compiler_versions() -> str:
    """``"jax=0.10.2 jaxlib=0.10.2 jax-cuda12-plugin=0.10.2 ..."`` (installed ones)."""
    out = []
    for name in _DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out.append(f"{name}={importlib.metadata.version(name)}")
    return " ".join(out)


def canonical(value: Any) -> str:
    """A ``repr`` of ``value`` independent of the hash seed (sets sorted)."""

    def walk(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            fields = {f.name: walk(getattr(v, f.name)) for f in dataclasses.fields(v)}
            return [type(v).__qualname__, fields]
        if isinstance(v, (set, frozenset)):
            return sorted((walk(x) for x in v), key=repr)
        if isinstance(v, dict):
            return sorted(([walk(k), walk(x)] for k, x in v.items()), key=repr)
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        return repr(v)

    return json.dumps(walk(value))


@functools.cache
def source_fingerprint() -> str:
    """The sha256 of every ``.py`` file of remat-kit."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def target_fingerprint(target: T.Target) -> str:
    """What of ``target`` the compiler sees (dataclass, ``GpuTargetConfig`` text, or the local
    backend's version and device kinds); every CPU target shares one fingerprint."""
    if T.compile_identity(target) == "cpu":
        import jax

        devices = jax.devices("cpu")
        kinds = ",".join(sorted({d.device_kind for d in devices}))
        return f"the CPU backend\n{devices[0].client.platform_version}\n{kinds}"
    parts = [repr(target)]
    if target.gpu is not None:
        parts.append(T.gpu_target_config(target))
    else:
        import jax

        platform = "cpu" if target.name == "cpu" else None
        devices = jax.devices(platform)
        parts.append(devices[0].client.platform_version)
        parts.append(",".join(sorted({d.device_kind for d in devices})))
    return "\n".join(parts)


class CachedExecutable:
    """A cached ``jax.stages.Compiled``: ``memory_analysis()`` and ``as_text()`` only."""

    def __init__(
        self,
        memory: Mapping[str, Any] | None,
        hlo_text: str | None,
        cost: Mapping[str, float] | None = None,
    ):
        self._memory = None if memory is None else types.SimpleNamespace(**memory)
        self._hlo = hlo_text
        self._cost = None if cost is None else dict(cost)

    def memory_analysis(self) -> Any:
        return self._memory

    def cost_analysis(self) -> dict[str, float] | None:
        return None if self._cost is None else dict(self._cost)

    def as_text(self) -> str | None:
        return self._hlo

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "this compile was read from remat-kit's compile cache: it has no executable"
        )


def cost_fields(compiled: Any) -> dict[str, float] | None:
    """``compiled.cost_analysis()``'s ``flops``, ``bytes accessed``, ``transcendentals`` and
    ``optimal_seconds`` (loop bodies once); None where not supported (deviceless GPU)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without it raises its own error types
        return None
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0] if cost else None
    if not cost:
        return None
    keep = ("flops", "bytes accessed", "transcendentals", "optimal_seconds")
    return {k: float(cost[k]) for k in keep if isinstance(cost.get(k), (int, float))} or None


def _memory_fields(compiled: Any) -> dict[str, Any] | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    out = {}
    for name in dir(m):
        if name.startswith("_"):
            continue
        value = getattr(m, name, None)
        if value is None or isinstance(value, (int, float, str, bool)):
            out[name] = value
    return out


def kernel_cache_file(target: T.Target, folder: Path | None) -> Path | None:
    """The kept ``xla_gpu_kernel_cache_file`` of a deviceless GPU ``target``
    (``$REMAT_KIT_KERNEL_CACHE_DIR`` or ``folder/kernels``; per target, versions, ``XLA_FLAGS``);
    None otherwise. Changes no figure (docs/performance.md).
    """
    root = Path(os.environ[ENV_KERNELS]) if os.environ.get(ENV_KERNELS) else None
    if root is None and folder is not None:
        root = folder / "kernels"
    if root is None or target.platform != "cuda" or not target.deviceless:
        return None
    flags = os.environ.get("XLA_FLAGS", "")
    text = "\0".join((compiler_versions(), target_fingerprint(target), flags))
    return root / f"{target.name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.kcache"


def keep_kernels(source: Path, dest: Path) -> None:
    """Copy ``source`` over ``dest`` when larger (up to :data:`KERNEL_CACHE_MAX_BYTES`), atomically
    by rename; write failures are ignored."""
    try:
        size = source.stat().st_size
        if size > KERNEL_CACHE_MAX_BYTES or (dest.exists() and dest.stat().st_size >= size):
            return
        with files.replacing(dest) as part:
            shutil.copyfile(source, part)
    except OSError:
        pass


@dataclasses.dataclass
class CompileCache:
    """The cache in ``folder`` (see the module docstring), at most ``max_bytes`` on disk.

    Build it with :meth:`from_env` (None when the cache is off).
    """

    folder: Path
    max_bytes: int = DEFAULT_MAX_BYTES

    @classmethod
    def from_env(cls) -> CompileCache | None:
        """The cache the environment asks for (module docstring), or None when it is off.

        Raises:
          ValueError: ``REMAT_KIT_CACHE_MAX_BYTES`` is not a size (``2GiB``, ``2e9``).
        """
        if not enabled():
            return None
        limit = os.environ.get(ENV_MAX_BYTES)
        try:
            max_bytes = DEFAULT_MAX_BYTES if not limit else parse_bytes(limit)
        except ValueError as err:
            raise ValueError(f"{ENV_MAX_BYTES}={limit!r}: {err}") from None
        return cls(default_folder(), max_bytes)

    @property
    def entries(self) -> Path:
        return self.folder / f"v{FORMAT_VERSION}"

    @staticmethod
    def key(lowered_text: str, target: T.Target, options: Mapping[str, Any]) -> str:
        """The sha256 of everything that decides a compile's result (module docstring).

        Args:
          lowered_text: the lowered program's StableHLO with debug info
            (``lowered.as_text(debug_info=True)``).
          target: what it is compiled for.
          options: the compiler options of the compile (paths left out).
        """
        opts = sorted((k, repr(v)) for k, v in options.items() if k not in _PATH_OPTIONS)
        lowered_text = canonical_locations(lowered_text)
        parts = (
            f"remat-kit compile cache v{FORMAT_VERSION}",
            compiler_versions(),
            target_fingerprint(target),
            repr(opts),
            repr([(k, os.environ.get(k)) for k in _ENV_KEYS]),
            lowered_text,
        )
        h = hashlib.sha256()
        for part in parts:
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    @staticmethod
    def request_key(*parts: Any) -> str:
        """The sha256 of a preset's analysis request, compiler versions and
        :func:`source_fingerprint`: the key of its stored reports."""
        h = hashlib.sha256()
        for part in (f"remat-kit report v{FORMAT_VERSION}", compiler_versions(),
                     source_fingerprint(), *map(canonical, parts)):  # fmt: skip
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def _path(self, key: str) -> Path:
        return self.entries / f"{key}{_SUFFIX}"

    def load_json(self, key: str) -> dict[str, Any] | None:
        """The JSON object stored under ``key`` by :meth:`store_json` (or :meth:`store`), or
        None (missing; an unreadable or foreign entry is removed). A hit marks the entry
        recently used."""
        path = self._path(key)
        try:
            data = json.loads(gzip.decompress(path.read_bytes()))
            if data.get("key") != key or data.get("format") != FORMAT_VERSION:
                raise ValueError("not this entry")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, EOFError):  # torn or foreign: drop it
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # least recently used goes first
        return data

    def store_json(self, key: str, data: Mapping[str, Any]) -> None:
        """Write a JSON object under ``key`` (atomically: a temporary file renamed into place),
        then evict down to ``max_bytes``; a failure to write (disk full, read-only) is
        ignored: the cache only ever saves time."""
        data = {**data, "format": FORMAT_VERSION, "key": key, "created": time.time()}
        blob = gzip.compress(json.dumps(data).encode(), compresslevel=1)
        try:
            files.write_bytes(self._path(key), blob)
        except OSError:
            return
        self.evict()

    def load(self, key: str) -> CompileResult | None:
        """The compile stored under ``key`` (its executable a :class:`CachedExecutable`), or
        None (missing; an unreadable entry is removed). A hit marks the entry recently used."""
        data = self.load_json(key)
        if data is None:
            return None
        try:
            dump = hlo.DumpFiles(**data["dump"])
            logged = [LogLine(*line) for line in data["log"]]
            result = CompileResult(
                compiled=CachedExecutable(
                    data["memory_analysis"], dump.hlo, data.get("cost_analysis")
                ),
                compile_s=float(data["compile_s"]),
                dump=dump,
                thread=0,
                start=0.0,
                end=0.0,
                logged=logged,
                cached=True,
                notes=tuple(data.get("notes", ())),
            )
        except (KeyError, TypeError, ValueError):  # not a compile's entry: drop it
            with contextlib.suppress(OSError):
                self._path(key).unlink()
            return None
        result.xla_remat_instructions = count_xla_remat(dump.hlo)
        return result

    def store(self, key: str, result: CompileResult, what: str = "") -> None:
        """Write ``result``'s artifacts under ``key`` (call after the compiler log capture
        ended, so its log lines are known), then evict down to ``max_bytes``. A result read
        from the cache, or a failure to write (disk full, read-only), stores nothing."""
        if result.cached:
            return
        data = {
            "what": what,
            "versions": compiler_versions(),
            "memory_analysis": _memory_fields(result.compiled),
            "cost_analysis": cost_fields(result.compiled),
            "compile_s": result.compile_s,
            "dump": dataclasses.asdict(result.dump),
            "log": [dataclasses.astuple(line) for line in result.log_lines()],
            "notes": list(result.notes),
        }
        self.store_json(key, data)

    def evict(self) -> int:
        """Remove the least recently used entries until the total is at most ``max_bytes``
        (and the part files of writes killed an hour ago or more); returns how many entries
        were removed."""
        try:
            found = list(os.scandir(self.entries))
        except OSError:
            return 0
        stale = time.time() - 3600
        for e in found:  # a write killed mid-way (remat_kit.files) left its part behind
            if e.name.endswith(".part"):
                with contextlib.suppress(OSError):
                    if e.stat().st_mtime < stale:
                        os.unlink(e.path)
        try:
            entries = [(e.stat().st_mtime, e.stat().st_size, e.path)
                       for e in found if e.name.endswith(_SUFFIX)]  # fmt: skip
        except OSError:
            return 0
        total = sum(size for _, size, _ in entries)
        removed = 0
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
            total -= size
        return removed

    def size_bytes(self) -> int:
        """Bytes of the entries on disk."""
        try:
            return sum(e.stat().st_size for e in os.scandir(self.entries)
                       if e.name.endswith(_SUFFIX))  # fmt: skip
        except OSError:
            return 0
