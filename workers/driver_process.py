"""``python -m workers.driver_process RUN_ID``: the entry point of a job's driver process. Django is set up here,
before the driver's own imports (models, services) run."""

import os
import sys

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ["STATEKEEPER_PROCESS"] = "driver"  # named in pg_stat_activity (settings: application_name)
django.setup()

from workers.driver import hard_exit, main  # noqa: E402  # needs the apps loaded above

# The run is recorded by now: end the process at once (a thread py4j or the JVM left behind must not keep a driver
# alive, holding memory and perhaps files, after its run ended).
hard_exit(main(sys.argv), "the run ended")
