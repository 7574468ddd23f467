"""``python -m workers.host_process HOST_ID``: the entry point of a shared driver (workers/host.py). Django is set
up here, before the driver's own imports (models, services) run."""

import os
import sys

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ["STATEKEEPER_PROCESS"] = "shared-driver"  # named in pg_stat_activity (settings: application_name)
django.setup()

from workers.driver import hard_exit  # noqa: E402  # needs the apps loaded above
from workers.host import main  # noqa: E402

hard_exit(main(sys.argv), "the shared driver ended")
