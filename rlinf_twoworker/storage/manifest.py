"""SHA256SUMS manifests: write them, verify them, and find the one that covers an input.

The format is `sha256sum`'s: one `<hex>  <relative name>` line a file. A model directory holds
its manifest; a data file has its manifest beside it. The digest of the manifest file itself is
what the preflight compares across nodes: equal digests mean every node checked the same list.
"""

from __future__ import annotations

import hashlib
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


def _check_entry(directory: Path, expected: str, name: str) -> None:
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
        actual = sha256_file(path)
    except OSError as exc:
        raise PreflightError(f"{where} cannot be read ({exc}); check its permissions") from exc
    if actual != expected:
        raise PreflightError(
            f"{where} has SHA256 {actual} but the manifest says {expected}; the file is "
            "corrupt or a different version: copy it again, or regenerate the manifest if the "
            "new file is intended"
        )


def verify_manifest(directory: Path) -> str:
    """Check every file `directory/SHA256SUMS` lists exists, is non-empty, readable and matches.

    Returns the hex SHA256 of the manifest file itself. Raises PreflightError naming the file,
    the problem and what to do.
    """
    directory = Path(directory)
    for expected, name in read_manifest(directory):
        _check_entry(directory, expected, name)
    return sha256_file(directory / MANIFEST_NAME)


def verify_input(path: str | Path) -> str:
    """Verify the manifest that covers an input (model directory or data file).

    A data file must be listed in the manifest beside it, so that an unlisted file is never
    reported as verified. Returns the manifest's digest.
    """
    path = Path(path)
    if not path.exists():
        raise PreflightError(f"input {path} does not exist; check the path and the storage mount")
    directory = manifest_dir_for(path)
    if path.is_file():
        names = {str(Path(name)) for _, name in read_manifest(directory)}
        if path.name not in names:
            raise PreflightError(
                f"input {path} is not listed in {directory / MANIFEST_NAME}; add its line "
                f"(`sha256sum {path.name} >> {MANIFEST_NAME}`)"
            )
    return verify_manifest(directory)
