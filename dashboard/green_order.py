"""What crosses between the console and a blue/green upgrade's new version ("green") in ``Run.green``: the order the
console writes (``GreenOrder``: what green runs, on which fork, following what) and the reports either side adds as
the upgrade goes (``REPORTS``). Both sides read and write ``Run.green`` through this module only: an order is checked
when written and when read, and a report is merged into the row under its lock, so that neither side overwrites what
the other wrote meanwhile.

The console writes the order (dashboard/services/blue_green.py); green's driver reads it and builds green's job from it
with ``GreenOrder.applied_to`` (workers/driver.py, workers/host.py).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from django.db import transaction

if TYPE_CHECKING:
    from dashboard.models import Job, Run

VERSION = 1  # an order another version wrote is refused rather than half read

# What is added beside the order as the upgrade goes, and the kind of each value.
REPORTS: dict[str, type | tuple[type, ...]] = {
    "up": str,  # green's driver of its own: its Spark is up (an ISO time), waiting for "go"
    "go": str,  # the console: the fork is made, start on it (the order is rewritten with it)
    "shadowing": int,  # green's driver: the newest batch it ran as a shadow (its number)
    "sink_problems": list,  # green's driver: the job's sinks it cannot write (sentences); empty when it can
    "handover": int,  # the console: green took over after this batch of its own numbering
    "promote": str,  # an operator's word before Action.asked held it (upgrades requested before it)
    "abort": str,
}


class OrderError(ValueError):
    """An order or a report that does not say what this version of the console and driver agree on."""


@dataclass(frozen=True)
class GreenOrder:
    """What green runs: the new version (``pipeline`` with ``parameters``), on the fork ``fork`` of the job's
    directory, following the job's checkpoint ``follow`` (green's batch n reads the job's batch n - ``shift``), with
    ``partitions`` state partitions; ``start_offset`` where a fork with no batch of its own starts reading (a state
    migration's, whose batch 0 follows the job's batch after the savepoint); ``boot``: its own driver starts before the
    fork is made and waits for "go"."""

    action: int
    fork: str
    follow: str
    pipeline: str
    parameters: dict[str, Any]
    partitions: int
    shift: int = 0
    start_offset: dict[str, Any] | None = None
    boot: bool = False
    version: int = field(default=VERSION)

    def __post_init__(self) -> None:
        kinds: dict[str, type | tuple[type, ...]] = {"action": int, "partitions": int, "shift": int, "version": int,
                                                     "boot": bool, "parameters": dict, "start_offset": (dict, type(None))}  # fmt: skip
        for f in fields(self):
            value = getattr(self, f.name)
            kind = kinds.get(f.name, str)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
                raise OrderError(f"green's order: {f.name} holds {type(value).__name__}")
        if self.version != VERSION:
            raise OrderError(f"green's order is of version {self.version}; this console reads version {VERSION}")

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def read(cls, green: Mapping[str, Any]) -> GreenOrder:
        """The order in a run's ``green`` (its reports aside); OrderError when a key is missing, unknown or of the
        wrong kind."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(green) - known - set(REPORTS))
        if unknown:
            raise OrderError(f"green's order has keys this version does not know: {', '.join(unknown)}")
        try:
            return cls(**{k: v for k, v in green.items() if k in known})
        except TypeError as exc:
            raise OrderError(f"green's order is incomplete: {exc}") from None

    def applied_to(self, job: Job) -> Job:
        """Green's job: a copy of the job with the order's version, values, fork, partitions and start."""
        green = copy.copy(job)
        green.pipeline, green.parameters = self.pipeline, dict(self.parameters)
        green.checkpoint_dir, green.state_partitions = self.fork, self.partitions
        if self.start_offset is not None:
            green.start_offset = self.start_offset
        return green


def reported(green: Mapping[str, Any], key: str) -> Any:
    """A report in a run's ``green`` (None when not made)."""
    if key not in REPORTS:
        raise OrderError(f"{key!r} is not a report green's run carries")
    return green.get(key)


def reports_checked(**values: Any) -> dict[str, Any]:
    """The reports, checked against REPORTS."""
    for key, value in values.items():
        if key not in REPORTS:
            raise OrderError(f"{key!r} is not a report green's run carries (dashboard/green_order.py)")
        if not isinstance(value, REPORTS[key]) or isinstance(value, bool):
            raise OrderError(f"green's report {key!r} holds {type(value).__name__}")
    return values


def order_write(run: Run, order: GreenOrder, **reports: Any) -> None:
    """Write the order into green's run (with any reports, e.g. "go"), the reports already made kept."""
    from dashboard.models import Run

    reports_checked(**reports)
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(id=run.id)
        kept = {k: v for k, v in (locked.green or {}).items() if k in REPORTS}
        locked.green = {**kept, **order.as_json(), **reports}
        locked.save(update_fields=["green"])
    run.green = locked.green


def report(run_id: int, **values: Any) -> dict[str, Any]:
    """Add reports to green's run under its row's lock (what the other side wrote meanwhile kept); its green after."""
    from dashboard.models import Run

    reports_checked(**values)
    with transaction.atomic():
        locked = Run.objects.select_for_update().filter(id=run_id).first()
        if locked is None:
            return {}
        locked.green = {**(locked.green or {}), **values}
        locked.save(update_fields=["green"])
        return dict(locked.green)
