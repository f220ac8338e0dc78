"""SHA256SUMS manifests: write them, verify them, and find the one that covers an input.

The format is `sha256sum`'s: one `<hex>  <relative name>` line a file. A model directory holds
its manifest; a data file has its manifest beside it. The digest of the manifest file itself is
what the preflight compares across nodes: equal digests mean every node checked the same list.

Hashing a model takes seconds a run (3-5 s for 3.3 GB on the H200 machine). With a `cache_dir`
(cluster.preflight.hash_cache_dir) a node remembers each digest it computed together with the
file's identity and change time (path, device, inode, size, mtime and ctime in nanoseconds):
a file still the same by all of these is not read again. Any write to a file, a copy over it
or a touch changes its ctime (which user programs cannot set back), so a changed file is
always hashed afresh; an entry that cannot be read is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from rlinf_twoworker.errors import PreflightError

MANIFEST_NAME = "SHA256SUMS"
_CHUNK = 8 * 1024 * 1024
_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


def sha256_file(path: Path) -> str:
    """Hex SHA256 of a file, read in chunks (model files are GBs)."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        while n := handle.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _identity(path: Path) -> dict[str, int | str]:
    st = path.stat()
    return {
        "path": str(path.resolve()),
        "dev": st.st_dev,
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }


def sha256_remembered(path: Path, cache_dir: Path | None) -> str:
    """sha256_file, from `cache_dir`'s entry for `path` while the file is unchanged since that
    digest was computed (see the module's docstring); None hashes every time."""
    if cache_dir is None:
        return sha256_file(path)
    before = _identity(path)
    entry = cache_dir / (hashlib.sha256(str(before["path"]).encode()).hexdigest()[:40] + ".json")
    try:
        saved = json.loads(entry.read_text())
        if saved.get("identity") == before and re.fullmatch(r"[0-9a-f]{64}", saved["sha256"]):
            return str(saved["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no entry yet, or one this code cannot use: hash and rewrite it
    digest = sha256_file(path)
    if _identity(path) == before:  # unchanged while it was read: worth remembering
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            partial = entry.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({"identity": before, "sha256": digest}))
            os.replace(partial, entry)  # two probes of one node may write it at once
        except OSError:
            pass  # an unwritable cache only costs the next run the hashing
    return digest


def manifest_dir_for(path: str | Path) -> Path:
    """The directory whose SHA256SUMS covers `path`: the path itself for a directory (a model),
    its parent for a file (a data file)."""
    path = Path(path)
    return path if path.is_dir() else path.parent


def write_manifest(directory: Path, files: Iterable[str] | None = None) -> Path:
    """Write `directory/SHA256SUMS` for `files` (names relative to `directory`).

    Without `files`: every regular file directly in the directory except the manifest, sorted.
    """
    directory = Path(directory)
    if files is None:
        names = sorted(
            p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST_NAME
        )
    else:
        names = list(files)
    lines = [f"{sha256_file(directory / name)}  {name}\n" for name in names]
    out = directory / MANIFEST_NAME
    out.write_text("".join(lines))
    return out


def read_manifest(directory: Path) -> list[tuple[str, str]]:
    """The (hex digest, relative name) entries of `directory/SHA256SUMS`, checked for syntax."""
    manifest = Path(directory) / MANIFEST_NAME
    if not manifest.is_file():
        raise PreflightError(
            f"manifest {manifest} is missing: every input needs a SHA256SUMS beside it (inside "
            "a model directory, in the parent directory of a data file); create it with "
            "`sha256sum FILES > SHA256SUMS` or rlinf_twoworker.storage.manifest.write_manifest"
        )
    try:
        text = manifest.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PreflightError(
            f"manifest {manifest} cannot be read ({exc}); check its permissions and encoding"
        ) from exc
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        match = _LINE.match(line)
        if match is None:
            raise PreflightError(
                f"manifest {manifest} line {number} is not '<64 hex digits>  <name>': "
                f"{line[:120]!r}; regenerate it with sha256sum"
            )
        name = match.group(2)
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise PreflightError(
                f"manifest {manifest} line {number} names {name!r}, which is outside its "
                "directory; list files by their path relative to the manifest"
            )
        entries.append((match.group(1).lower(), name))
    if not entries:
        raise PreflightError(
            f"manifest {manifest} lists no files; regenerate it over the input's files"
        )
    return entries


def _check_entry(directory: Path, expected: str, name: str, cache_dir: Path | None) -> None:
    path = directory / name
    where = f"{path} (listed in {directory / MANIFEST_NAME})"
    if not path.is_file():
        raise PreflightError(
            f"{where} is missing or not a regular file; copy the input again to this node's "
            "storage or fix the manifest"
        )
    if path.stat().st_size == 0:
        raise PreflightError(
            f"{where} is empty (0 bytes); the copy is incomplete: copy the input again"
        )
    try:
        actual = sha256_remembered(path, cache_dir)
    except OSError as exc:
        raise PreflightError(f"{where} cannot be read ({exc}); check its permissions") from exc
    if actual != expected:
        raise PreflightError(
            f"{where} has SHA256 {actual} but the manifest says {expected}; the file is "
            "corrupt or a different version: copy it again, or regenerate the manifest if the "
            "new file is intended"
        )


def verify_manifest(directory: Path, cache_dir: Path | None = None) -> str:
    """Check every file `directory/SHA256SUMS` lists exists, is non-empty, readable and matches
    (digests remembered in `cache_dir`, when given, while a file is unchanged).

    Returns the hex SHA256 of the manifest file itself. Raises PreflightError naming the file,
    the problem and what to do.
    """
    directory = Path(directory)
    for expected, name in read_manifest(directory):
        _check_entry(directory, expected, name, cache_dir)
    return sha256_file(directory / MANIFEST_NAME)


def verify_input(path: str | Path, cache_dir: Path | None = None) -> str:
    """Verify the manifest that covers an input (model directory or data file); `cache_dir`:
    as for verify_manifest.

    A data file must be listed in the manifest beside it, so that an unlisted file is never
    reported as verified. Returns the manifest's digest.
    """
    path = Path(path)
    if not path.exists():
        raise PreflightError(f"input {path} does not exist; check the path and the storage mount")
    return verify_manifest(covering_manifest(path), cache_dir)


def covering_manifest(path: Path) -> Path:
    """The directory whose SHA256SUMS covers the existing input `path`, once that manifest
    reads and, for a data file, lists it (no file hashed: the request's check uses this too).
    Raises PreflightError naming the manifest and what to do."""
    directory = manifest_dir_for(path)
    names = {str(Path(name)) for _, name in read_manifest(directory)}
    if path.is_file() and path.name not in names:
        raise PreflightError(
            f"input {path} is not listed in {directory / MANIFEST_NAME}; add its line "
            f"(`sha256sum {path.name} >> {MANIFEST_NAME}`)"
        )
    return directory
