"""Which code a pipeline is: the installed distribution that holds its module, and a fingerprint of every file of
that distribution's packages (so an edit to a helper module, or to a data file, is seen without a version bump)."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path
from types import ModuleType

SKIPPED = ("__pycache__", ".egg-info", ".dist-info")
_owners: tuple[tuple[int, ...], Mapping[str, list[str]]] | None = None


def _modified(entry: str) -> int:
    try:
        return os.stat(entry or ".").st_mtime_ns
    except OSError:
        return 0


def installed_owners() -> Mapping[str, list[str]]:
    """``packages_distributions()``: which installed distributions hold each top-level package. It reads every
    distribution's file list (a twentieth of a second or more), so it is read again only when a directory on
    ``sys.path`` has changed since: installing, upgrading or removing a distribution adds or removes its
    ``.dist-info`` there."""
    global _owners
    key = tuple(_modified(entry) for entry in sys.path)
    cached = _owners
    if cached is not None and cached[0] == key:
        return cached[1]
    found = packages_distributions()
    _owners = (key, found)
    return found


@dataclass(frozen=True)
class CodeVersion:
    """Which code a pipeline is: where it was found (``module:attribute``), the installed distribution that holds it,
    and a hash of every file of that distribution's packages (so an edit without a version bump, even to a helper
    module, is seen)."""

    reference: str
    package: str  # "name version", empty for a module outside any distribution
    code_hash: str  # sha256 over the files' relative paths and contents; "unknown" when none could be read
    files: int = 0


def code_files(module: ModuleType, owners: Mapping[str, list[str]] | None = None) -> list[Path]:
    """The files that make up the module's code: every file under the top-level packages of its distribution, or
    (outside a distribution) the module's own file. ``owners``: ``installed_owners()``, when the caller has it."""
    found = installed_owners() if owners is None else owners
    top = module.__name__.partition(".")[0]
    dists = found.get(top, [])
    roots: list[Path] = []
    if dists:
        tops = {name for name, holders in found.items() if dists[0] in holders}
        for name in sorted(tops):
            package = sys.modules.get(name)
            for where in getattr(package, "__path__", None) or []:
                roots.append(Path(where))
            if package is not None and not hasattr(package, "__path__") and package.__file__:
                roots.append(Path(package.__file__))
    if not roots:
        return [Path(module.__file__)] if module.__file__ else []
    files: list[Path] = []
    for root in roots:
        candidates = [root] if root.is_file() else sorted(root.rglob("*"))
        files += [f for f in candidates if f.is_file() and not any(part.endswith(SKIPPED) for part in f.parts)
                  and f.suffix not in (".pyc", ".pyo")]  # fmt: skip
    return files


def code_version(module: ModuleType, reference: str = "") -> CodeVersion:
    owners = installed_owners()
    files = code_files(module, owners)
    base = Path(os.path.commonpath(files)) if files else Path()
    digest = hashlib.sha256()
    read = 0
    for path in files:
        try:
            content = path.read_bytes()
        except OSError:
            continue
        digest.update(f"{path.relative_to(base) if path != base else path.name}\0{len(content)}\0".encode())
        digest.update(content)
        read += 1
    top = module.__name__.partition(".")[0]
    dists = owners.get(top, [])
    package = ""
    if dists:
        try:
            package = f"{dists[0]} {distribution(dists[0]).version}"
        except PackageNotFoundError:
            package = dists[0]
    return CodeVersion(reference, package, digest.hexdigest() if read else "unknown", read)


def newest_change(module: ModuleType) -> float:
    """The latest modification time among the module's code files (a warm process compares it with its start)."""
    return max((p.stat().st_mtime for p in code_files(module) if p.exists()), default=0.0)
