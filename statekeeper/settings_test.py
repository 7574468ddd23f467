"""Settings for the test suite: its own Redis database and PostgreSQL database, so a running console is untouched.

Processes the tests start (Celery worker, drivers) inherit STATEKEEPER_TEST_PROCESS=1 and use the test database, as
the app role.
"""

import os
import tempfile

os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("STATEKEEPER_ENV", "development")
# the suite's file sinks write under the temporary directory (pytest's tmp_path); one test shows a directory elsewhere
# refused
os.environ.setdefault("STATEKEEPER_FILE_SINK_ROOTS", tempfile.gettempdir())

from statekeeper.settings import *  # noqa: E402,F403
from statekeeper.settings import DATABASES, env_str  # noqa: E402

CELERY_BROKER_URL = REDIS_URL  # noqa: F405
PROGRESS_STREAM = "statekeeper:test:progress"
LIVE_STREAM = "statekeeper:test:live"
LEASE_TTL_SECONDS = 6
LEASE_RENEW_SECONDS = 1
STOP_GRACE_SECONDS = 60
STANDBY_IDLE_SECONDS = 8
STATE_READER_IDLE_SECONDS = 120  # the session's teardown ends it sooner
STATE_READER_WARM_PIPELINES_SECONDS = 0  # a reader's warm-up would plan every pipeline beside the tests' reads
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
if os.environ.get("STATEKEEPER_TEST_PROCESS") and str(DATABASES["default"]["ENGINE"]).endswith("postgresql"):
    DATABASES["default"]["NAME"] = DATABASES["default"]["TEST"]["NAME"]  # type: ignore[index]
    # and connect as the app role, as a deployment does: the suite proves the grants are enough and no more
    DATABASES["default"]["USER"] = DB_APP_ROLE  # noqa: F405
    DATABASES["default"]["PASSWORD"] = DB_APP_PASSWORD  # noqa: F405
CHECKPOINT_ROOT = Path(env_str("STATEKEEPER_CHECKPOINT_ROOT", "/tmp/statekeeper-tests/checkpoints")).resolve()  # noqa: F405
LOG_ROOT = CHECKPOINT_ROOT.parent / "logs"
# Tests serve static files from the apps' folders: no collectstatic step.
STATIC_ROOT = None  # type: ignore[assignment]
WHITENOISE_USE_FINDERS = True
# Alert e-mails from the processes tests start are written as files (in the test process Django keeps them in
# mail.outbox).
EMAIL_BACKEND = "django.core.mail.backends.filebased.EmailBackend"
EMAIL_FILE_PATH = str(CHECKPOINT_ROOT.parent / "mail")
