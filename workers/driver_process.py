"""``python -m workers.driver_process RUN_ID``: the entry point of a job's driver process. Django is set up here,
before the driver's own imports (models, services) run."""

import os
import sys

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
django.setup()

from workers.driver import main  # noqa: E402  # needs the apps loaded above

sys.exit(main(sys.argv))
