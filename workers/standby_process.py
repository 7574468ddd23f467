"""``python -m workers.standby_process STANDBY_ID``: a warm standby driver (workers/standby.py). Django is set up here,
before the standby's own imports (models, services) run."""

import os
import sys

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ["STATEKEEPER_PROCESS"] = "standby"  # named in pg_stat_activity (settings: application_name)
django.setup()

from workers.driver import hard_exit  # noqa: E402  # needs the apps loaded above
from workers.standby import main  # noqa: E402

hard_exit(main(sys.argv), "the standby ended")
