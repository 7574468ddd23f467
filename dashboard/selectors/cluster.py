"""A Spark standalone cluster's cores, from its master's JSON: how many, who holds them, and why a job's application
waits. Read by a driver while its job waits for executors, by the alerts, and before a start (the form, the start
button, the API and a plan warn when the cluster has too few free cores for the job). Django only in
``free_cores_warning``; the rest is plain Python, which a driver's thread and the cluster tool use as well."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from typing import Any

CORES_WAIT = "Waiting for cores on the cluster"  # how a starting run's message begins while its driver has no executor
SHARED_APP = "statekeeper-shared-"  # how the shared drivers' applications are named on the master (workers/host.py)


def master_status(ui_url: str, timeout: float = 5) -> dict[str, Any]:
    """The master's own JSON: its workers (state, cores, memory) and applications."""
    with urllib.request.urlopen(f"{ui_url}/json/", timeout=timeout) as response:  # noqa: S310 - our own master
        return dict(json.load(response))


@dataclass
class Cores:
    """A standalone cluster's cores as its master counts them: on its ALIVE workers, and held by each application."""

    total: int
    used: int
    workers: int
    apps: list[dict[str, Any]]  # id, name, cores (granted), state (RUNNING, WAITING)

    @property
    def free(self) -> int:
        return max(0, self.total - self.used)

    def holders(self) -> str:
        """'statekeeper-orders (1), statekeeper-clicks (1)': who holds the cores, most first."""
        held = sorted((a for a in self.apps if a["cores"]), key=lambda a: (-a["cores"], a["name"]))
        return ", ".join(f"{a['name']} ({a['cores']})" for a in held) or "no application"


def cluster_cores(ui_url: str, timeout: float = 3) -> Cores | None:
    """The cluster's cores and who holds them, from its master's JSON; None when the master does not answer."""
    try:
        state = master_status(ui_url, timeout)
    except (OSError, ValueError):
        return None
    alive = [w for w in state.get("workers", []) if w.get("state") == "ALIVE"]
    apps = [
        {
            "id": a.get("id", ""),
            "name": a.get("name", ""),
            "cores": int(a.get("cores") or 0),
            "state": a.get("state", ""),
        }
        for a in state.get("activeapps", [])
    ]
    return Cores(
        total=sum(int(w.get("cores") or 0) for w in alive),
        used=sum(int(w.get("coresused") or 0) for w in alive),
        workers=len(alive),
        apps=apps,
    )


def waiting_for_cores(cores: Cores, app_id: str, wanted: int, who: str = "the job") -> str:
    """Why the application ``app_id`` (``who`` asks for its cores) has no executor yet, in the on-call's words; empty
    when it has its cores (or the master does not list it)."""
    app = next((a for a in cores.apps if a["id"] == app_id), None)
    if app is None or (app["state"] != "WAITING" and app["cores"] > 0):
        return ""
    return (
        f"{CORES_WAIT}: {who} asks for {wanted} core(s) and has {app['cores']}; the cluster's "
        f"{cores.total} core(s) on {cores.workers} worker(s) are held by {cores.holders()} ({cores.free} free). It "
        "starts when cores free up: stop or scale down another job, or add a worker."
    )


def short_of_cores(cores: Cores | None, wanted: int, holder: str = "") -> str:
    """A warning before a job starts: the cluster has fewer free cores than ``wanted`` (the job's parallelism), so it
    would wait; empty when it has them or the master cannot say. ``holder``: an application the job already runs as,
    whose cores would be its own again."""
    if cores is None:
        return ""
    own = sum(a["cores"] for a in cores.apps if holder and a["name"] == holder)
    if cores.free + own >= wanted:
        return ""
    return (
        f"the cluster has {cores.free} free core(s) of {cores.total} (held by {cores.holders()}) and the job asks for "
        f"{wanted}: it would wait in 'starting' until cores free up"
    )


def master_ui(master: str, configured: str = "") -> str:
    """The cluster master's web UI (its JSON says who holds the cores): ``configured``
    (STATEKEEPER_SPARK_MASTER_UI), else port 8080 on the master's host."""
    return configured or f"http://{master.removeprefix('spark://').split(':')[0]}:8080"


def free_cores_warning(job: Any) -> str:
    """Before ``job`` starts on the console's cluster: why it would wait for cores (empty in local mode, when the
    cluster has them, or when its master cannot say)."""
    from django.conf import settings

    master = settings.SPARK_MASTER
    if not master or master.startswith("local"):
        return ""
    cores = cluster_cores(master_ui(master, settings.SPARK_MASTER_UI))
    if getattr(job, "driver", "") == "shared":  # the shared driver's application, whatever the job's parallelism
        if cores is None or any(app["name"].startswith(SHARED_APP) for app in cores.apps):
            return ""
        return short_of_cores(cores, settings.SHARED_DRIVER_CORES)
    return short_of_cores(cores, job.parallelism, f"statekeeper-{job.name}")
