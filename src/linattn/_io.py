"""File input and output shared by checkpoints, training runs and configs: one atomic-write scheme,
one fsync, SHA-256 of a file, and JSON / TOML readers whose errors name the file.

Atomic write: the new content is written under a temporary name beside its destination
(`.<name>.tmp-<pid>-<random>`), flushed to disk, renamed over the destination (`os.replace`, atomic
on POSIX and Windows) and the parent folder is flushed, so a crash leaves the old content or the
new one, never a torn one. The same scheme writes files, folders (a checkpoint) and pointers. A
process killed mid-write leaves its temporary behind; `remove_stale_temporaries` removes those whose
writer is gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterable


def fsync_path(path) -> None:
    """Flushes a file or a folder (its entries) to disk; platforms that cannot are skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - directories on some filesystems
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def atomic_write(path, write: Callable[[Path], None]) -> Path:
    """write(tmp) creates the new content (a file, a folder whose files it flushed itself, or a
    symlink) under a temporary name beside `path`; it is then flushed and renamed over `path` (an
    existing folder at `path` is removed first, after the new one is complete). The temporary is
    removed when `write` fails. Returns `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        fsync_path(tmp)
        if path.is_dir() and not path.is_symlink() and tmp.is_dir():
            shutil.rmtree(path)  # re-writing a folder: os.replace cannot replace a non-empty one
        os.replace(tmp, path)
    finally:
        if tmp.exists() or tmp.is_symlink():
            _remove(tmp)
    fsync_path(path.parent)
    return path


#: The name atomic_write gives the temporary of `<name>`: `.<name>.tmp-<pid>-<8 hex digits>`.
ATOMIC_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")


def process_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (POSIX; elsewhere: only this process)."""
    if pid == os.getpid():
        return True
    if os.name != "posix":  # os.kill(pid, 0) would terminate the process on Windows
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(folder, names: Callable[[str], bool],
                             patterns: Iterable[re.Pattern] = (ATOMIC_TEMPORARY,)) -> list[Path]:
    """Removes the temporaries left in `folder` by writes that were killed: entries whose name
    matches one of `patterns` (default: atomic_write's), whose "name" group (when the pattern has one)
    passes `names`, and whose writer is gone: the "pid" group names a process that no longer runs or
    this one (call this only when the process is not writing into `folder`), or the pattern has no
    pid. Nothing else is touched. Returns the removed paths."""
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        for pattern in patterns:
            m = pattern.match(entry.name)
            if m is None:
                continue
            groups = m.groupdict()
            if "name" in groups and not names(groups["name"]):
                break
            pid = int(groups["pid"]) if groups.get("pid") else None
            if pid is None or pid == os.getpid() or not process_alive(pid):
                _remove(entry)
                removed.append(entry)
            break
    return removed


def write_text_synced(path, text: str) -> None:
    """Writes `text` (UTF-8) to `path` and flushes it to disk (not atomic: for files inside a folder
    that `atomic_write` moves into place)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def sha256_file(path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_json(path):
    """The JSON value in `path`. FileNotFoundError when it is missing; ValueError naming the file when
    it is not valid UTF-8 JSON."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:  # e.g. 100,000 nested lists: valid JSON, but no config nests that deep
        raise ValueError(f"{path} nests its JSON values too deeply to be read (a corrupt or hostile file)") from None


def read_toml(path) -> dict:
    """The table in a TOML file (tomllib; tomli on Python 3.10). Errors as `read_json`'s."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ValueError(f"{path}: reading TOML on Python < 3.11 needs the 'tomli' package; "
                             "install it or use a JSON config") from None
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from None


def read_config_file(path) -> dict:
    """A settings file as a dict: TOML for a `.toml` suffix, JSON (an object) otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    if path.suffix.lower() == ".toml":
        return read_toml(path)
    d = read_json(path)
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d
