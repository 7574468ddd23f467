"""What the benchmarks read of processes from /proc: a process tree, and a process's proportional and resident sizes."""

from __future__ import annotations

import collections
from pathlib import Path


def parents() -> dict[int, int]:
    """Every process's parent, by pid (a process that ends while read is left out)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return found


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for child, parent in parents().items():
        children[parent].append(child)
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def cpu_ticks(stat: Path) -> tuple[str, int, int]:
    """From a process's or thread's ``stat`` file: its name, its own CPU ticks (user and system), and those of its
    children that ended and were waited for."""
    text = stat.read_text()
    fields = text.rsplit(")", 1)[1].split()
    return (
        text[text.index("(") + 1 : text.rindex(")")],
        int(fields[11]) + int(fields[12]),
        int(fields[13]) + int(fields[14]),
    )


def command(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def sizes(pid: int) -> tuple[int, int]:
    """PSS and RSS in KiB."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if parts and parts[0] in ("Pss:", "Rss:"):
            values[parts[0]] = int(parts[1])
    return values.get("Pss:", 0), values.get("Rss:", 0)
