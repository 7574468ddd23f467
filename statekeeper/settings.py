"""Statekeeper settings: every value comes from the environment, with embedded defaults for a local run."""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from celery.schedules import crontab
from cryptography.fernet import Fernet
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a whole number, not {raw!r}") from None


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "true" if default else "false").lower()
    if raw not in ("1", "0", "true", "false", "yes", "no"):
        raise ImproperlyConfigured(f"{name} must be true or false, not {raw!r}")
    return raw in ("1", "true", "yes")


def database_from_url(url: str) -> dict[str, object]:
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        # Web, workers and drivers all write: WAL lets readers go on, IMMEDIATE takes the write lock up front, and the
        # busy timeout waits for it instead of failing with "database is locked".
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": parsed.path or str(BASE_DIR / "var" / "db.sqlite3"),
            "OPTIONS": {
                "timeout": 30,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    if parsed.scheme in ("postgres", "postgresql"):
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": parsed.path.lstrip("/"),
            "USER": unquote(parsed.username or ""),
            "PASSWORD": unquote(parsed.password or ""),
            "HOST": parsed.hostname or "",
            "PORT": str(parsed.port or ""),
            # a worker's or a driver's connection is kept this long (it runs one thread's work after another); the web
            # process keeps none (statekeeper/asgi.py sets 0)
            "CONN_MAX_AGE": env_int("STATEKEEPER_DB_CONN_MAX_AGE", 60),
            "CONN_HEALTH_CHECKS": True,
            # which process a connection is (pg_stat_activity.application_name), for sizing max_connections
            "OPTIONS": {"application_name": f"statekeeper-{env_str('STATEKEEPER_PROCESS', 'process')}"[:63]},
            "TEST": {"NAME": env_str("STATEKEEPER_TEST_DB", f"test_{parsed.path.lstrip('/')}")},
        }
    raise ImproperlyConfigured(f"DATABASE_URL must start with postgres:// or sqlite://, not {url!r}")


# bin/dev and the tests run with STATEKEEPER_ENV=development; anything else is a deployment, which must be configured.
DEVELOPMENT = env_str("STATEKEEPER_ENV", "production") == "development"
DEV_SECRET = "dev-only-not-secret"
DEBUG = env_bool("STATEKEEPER_DEBUG", False)
SECRET_KEY = env_str("STATEKEEPER_SECRET_KEY", DEV_SECRET)
ALLOWED_HOSTS = [h.strip() for h in env_str("STATEKEEPER_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h.strip()]


# The key that encrypts the secrets the console keeps for jobs' sinks (Fernet: a url-safe base64 32-byte key, as
# `python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"` prints). Several keys,
# comma-separated, rotate it: the first encrypts, every one decrypts. In development, without one, a key is derived
# from the development secret key (not secret: development only).
SECRETS_KEYS = [k.strip() for k in env_str("STATEKEEPER_SECRETS_KEY", "").split(",") if k.strip()]
for _key in SECRETS_KEYS:
    try:
        Fernet(_key)
    except ValueError:
        raise ImproperlyConfigured(
            "STATEKEEPER_SECRETS_KEY must be Fernet keys (32 url-safe base64-encoded bytes), comma-separated"
        ) from None


def deployment_problems(secret: str, debug: bool, hosts: list[str], secrets_keys: list[str] | None = None) -> list[str]:
    """What makes these settings unsafe outside development."""
    problems = []
    if secret == DEV_SECRET or len(secret) < 32:
        problems.append("STATEKEEPER_SECRET_KEY is unset or shorter than 32 characters")
    if not secrets_keys:
        problems.append("STATEKEEPER_SECRETS_KEY is unset (it encrypts the secrets of the jobs' sinks)")
    if debug:
        problems.append("STATEKEEPER_DEBUG is on (it shows settings and code to anyone who hits an error)")
    if not hosts or "*" in hosts:
        problems.append("STATEKEEPER_ALLOWED_HOSTS is empty or '*'")
    return problems


if not DEVELOPMENT and (unsafe := deployment_problems(SECRET_KEY, DEBUG, ALLOWED_HOSTS, SECRETS_KEYS)):
    raise ImproperlyConfigured(
        "Refusing to start with unsafe settings: " + "; ".join(unsafe) + ". Set them, or STATEKEEPER_ENV=development "
        "for a local run (bin/dev does)."
    )

# Behind HTTPS (STATEKEEPER_HTTPS=1): cookies only over HTTPS, HSTS; a proxy that terminates TLS is trusted for the
# scheme only when named (STATEKEEPER_PROXY_SSL_HEADER=1: it sets X-Forwarded-Proto and strips the client's).
HTTPS = env_bool("STATEKEEPER_HTTPS", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = HTTPS
SECURE_HSTS_SECONDS = env_int("STATEKEEPER_HSTS_SECONDS", 31_536_000) if HTTPS else 0
SECURE_SSL_REDIRECT = HTTPS and env_bool("STATEKEEPER_SSL_REDIRECT", True)
if env_bool("STATEKEEPER_PROXY_SSL_HEADER", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# Proxies whose X-Forwarded-For is believed (addresses, comma-separated); none by default.
TRUSTED_PROXIES = frozenset(p.strip() for p in env_str("STATEKEEPER_TRUSTED_PROXIES", "").split(",") if p.strip())
CSRF_TRUSTED_ORIGINS = [o.strip() for o in env_str("STATEKEEPER_CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()]
SESSION_COOKIE_HTTPONLY = True
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
# Only the console's own scripts run: the templates have no inline scripts or handlers (keep it that way); Plotly
# injects style elements, hence inline styles.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:", "blob:"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    }
}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "dashboard",
    "csp",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "dashboard.request_guard.RequestGuard",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
]
ROOT_URLCONF = "statekeeper.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "dashboard.access.context",
            ]
        },
    }
]
ASGI_APPLICATION = "statekeeper.asgi.application"
DATABASES = {"default": database_from_url(env_str("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/statekeeper"))}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# The role the running console connects as (web, workers, drivers): after every `migrate` the migrating owner grants it
# what the app needs and nothing on the audit trail beyond SELECT and INSERT, so the app cannot rewrite its own history.
DB_APP_ROLE = env_str("STATEKEEPER_DB_APP_ROLE", "statekeeper_app")
DB_APP_PASSWORD = env_str("STATEKEEPER_DB_APP_PASSWORD", "")
AUTH_PASSWORD_VALIDATORS: list[dict[str, Any]] = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 12}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LANGUAGE_CODE = "en"
TIME_ZONE = "UTC"
USE_TZ = True
STATIC_URL = "static/"
# plotly.js comes from the installed plotly package: no CDN, there may be no internet where the console runs
STATICFILES_DIRS = [("plotly", Path(str(__import__("plotly").__file__)).parent / "package_data")]
STATIC_ROOT = BASE_DIR / "var" / "static"
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL)
# The Kafka cluster the demo and the tests use, and the default servers of a new Kafka job (bin/lib.sh starts a
# one-node broker here when none answers)
KAFKA_BOOTSTRAP = env_str("STATEKEEPER_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
CELERY_TASK_ACKS_LATE = False
CELERY_TASK_TIME_LIMIT = 120
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}
# A worker reserves one task beyond the ones it runs: a task queued behind a long one goes to a free worker.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BEAT_SCHEDULE = {
    "ingest-progress": {"task": "workers.tasks.ingest_progress", "schedule": 1.0},
    "advance-actions": {"task": "workers.tasks.advance_actions", "schedule": 1.0},
    "sample-source-lag": {"task": "workers.tasks.sample_source_lag", "schedule": 5.0},
    "trim-dead-letters": {"task": "workers.tasks.trim_dead_letters", "schedule": 60.0},
    "supervise-jobs": {"task": "workers.tasks.supervise_jobs", "schedule": 5.0},
    "periodic-savepoints": {"task": "workers.tasks.periodic_savepoints", "schedule": 60.0},
    "rollup-checkpoints": {"task": "workers.tasks.rollup_checkpoints", "schedule": 30.0},
    "evaluate-alerts": {"task": "workers.tasks.evaluate_alerts", "schedule": 5.0},
    "autoscale": {"task": "workers.tasks.autoscale", "schedule": 60.0},
    "capacity-report": {"task": "workers.tasks.capacity_report", "schedule": crontab(hour=7, minute=0, day_of_week=1)},
    "restore-drills": {"task": "workers.tasks.restore_drills", "schedule": crontab(hour=3, minute=30)},
}

# Pipelines the console can run: "module:attribute" references, the shipped examples first, then the user's
# (STATEKEEPER_PIPELINES, comma-separated); installed packages add theirs through the entry-point group
# "statekeeper.pipelines". dashboard/pipelines.py loads and checks them.
BUILTIN_PIPELINES = [
    f"workers.spark.pipelines.{module}:PIPELINE"
    for module in (
        "url_counts",
        "order_state_machine",
        "order_state_buckets",
        "count_window_average",
        "dedup",
        "minute_windows",
    )
] + ["workers.spark.pipelines.url_counts:LIVE"]
PIPELINES = BUILTIN_PIPELINES + [p.strip() for p in env_str("STATEKEEPER_PIPELINES", "").split(",") if p.strip()]

# Where every job's checkpoint lives: <root>/<job name>/checkpoint. Users name jobs, never paths.
CHECKPOINT_ROOT = Path(env_str("STATEKEEPER_CHECKPOINT_ROOT", str(BASE_DIR / "var" / "checkpoints"))).resolve()
LOG_ROOT = Path(env_str("STATEKEEPER_LOG_ROOT", str(BASE_DIR / "var" / "logs"))).resolve()
# A log past LOG_MAX_MB is copied to <log>.1 (LOG_KEEP parts) and cut in place; a log or part nothing has written for
# LOG_RETENTION_DAYS is removed (dashboard/services/logs.py, run with the roll-ups).
LOG_MAX_MB = env_int("STATEKEEPER_LOG_MAX_MB", 50)
LOG_KEEP = env_int("STATEKEEPER_LOG_KEEP", 3)
LOG_RETENTION_DAYS = env_int("STATEKEEPER_LOG_RETENTION_DAYS", 14)
if LOG_MAX_MB < 1 or LOG_KEEP < 0 or LOG_RETENTION_DAYS < 1:
    raise ImproperlyConfigured(
        "STATEKEEPER_LOG_MAX_MB and STATEKEEPER_LOG_RETENTION_DAYS must be 1 or more, STATEKEEPER_LOG_KEEP 0 or more"
    )
# A driver renews its lease every LEASE_RENEW seconds; a lease not renewed for LEASE_TTL seconds is expired.
LEASE_TTL_SECONDS = env_int("STATEKEEPER_LEASE_TTL", 20)
LEASE_RENEW_SECONDS = env_int("STATEKEEPER_LEASE_RENEW", 3)
# Empty: local[<parallelism>] per job. Set to spark://host:7077 to run drivers against a standalone cluster.
# This process's host, as runs and standbys record it: a driver on another host is judged by its lease, not its pid,
# and killed through that host's queue (host.<id>), which every Celery worker consumes besides the shared one.
HOST_ID = env_str("STATEKEEPER_HOST_ID", socket.gethostname())
SPARK_MASTER = env_str("STATEKEEPER_SPARK_MASTER", "")
SPARK_MASTER_UI = env_str("STATEKEEPER_SPARK_MASTER_UI", "")  # the master's web UI, linked from the job page
STOP_GRACE_SECONDS = env_int("STATEKEEPER_STOP_GRACE", 120)
# The shared driver (jobs with driver=shared): the cores of its local[N] master and its JVM's heap. Its jobs share
# them: each query's tasks go to a fair-scheduler pool of the job's own.
SHARED_DRIVER_CORES = env_int("STATEKEEPER_SHARED_DRIVER_CORES", os.cpu_count() or 2)
SHARED_DRIVER_MEMORY = env_str("STATEKEEPER_SHARED_DRIVER_MEMORY", "2g")
# Its jobs' batches start at phases spread over their trigger interval, not all on Spark's tick (workers/host.py).
SHARED_DRIVER_SPREAD = env_bool("STATEKEEPER_SHARED_DRIVER_SPREAD", True)
PROGRESS_STREAM = env_str("STATEKEEPER_PROGRESS_STREAM", "statekeeper:progress")
# Every committed batch is also pushed here for the browsers; its entry ids are the server-sent events' ids.
LIVE_STREAM = env_str("STATEKEEPER_LIVE_STREAM", "statekeeper:live")
# Every action off, whatever the role (a console for watching only, or a freeze during an incident review).
# Where file sources may read from (comma-separated directories): a job reads a directory under one of them.
FILE_SOURCE_ROOTS = [
    Path(p.strip()).resolve()
    for p in env_str("STATEKEEPER_FILE_SOURCE_ROOTS", str(BASE_DIR / "var" / "inbox")).split(",")
    if p.strip()
]
# Where a pipeline's file sinks may write (comma-separated directories): a sink's directory must be under one of them,
# so that a job's parameters cannot aim its output at any directory the console's user can write to.
FILE_SINK_ROOTS = [
    Path(p.strip()).resolve()
    for p in env_str("STATEKEEPER_FILE_SINK_ROOTS", str(BASE_DIR / "var" / "lake")).split(",")
    if p.strip()
]
LIVE_STREAMS_PER_USER = env_int("STATEKEEPER_LIVE_STREAMS_PER_USER", 6)
LIVE_STREAMS_TOTAL = env_int("STATEKEEPER_LIVE_STREAMS_TOTAL", 200)
# an audit export holds at most this many rows (the newest): narrow the time range for older ones
AUDIT_CSV_MAX_ROWS = env_int("STATEKEEPER_AUDIT_CSV_MAX_ROWS", 100_000)
# a standby driver whose job has not been running for this long ends (the next running driver gets a new one)
STANDBY_IDLE_SECONDS = env_int("STATEKEEPER_STANDBY_IDLE_SECONDS", 120)
# an upgrade or rescale of a job with a driver of its own restarts the job in the same driver process (its JVM up, its
# code loaded) when it can: the driver waits this long after its run's stop for the job's next run. 0: a new driver
DRIVER_REUSE_SECONDS = env_int("STATEKEEPER_DRIVER_REUSE_SECONDS", 60)
# a driver of its own starts a fork server when a restart in the same process is coming (workers/next_run.py)
OWN_DRIVER_FORKS = env_bool("STATEKEEPER_OWN_DRIVER_FORKS", True)
# the spare shared driver runs a warm query for each pipeline and backend of the shared jobs with standby on: about
# 1.6 GB rather than 0.55 GB, for a takeover's first commit in about 1.6 s rather than 12 s
SPARE_WARM_QUERIES = env_bool("STATEKEEPER_SPARE_WARM_QUERIES", True)
# The warm state reader (workers/spark/state_reader.py): one per deployment (BASE_DIR and database), started on the
# first state read and ended after this long without one. 0 reads every time in a new process.
STATE_READER_IDLE_SECONDS = env_int("STATEKEEPER_STATE_READER_IDLE_SECONDS", 900)
# As it warms up, the reader plans each registered pipeline once, as an upgrade's preview does, those in the modules of
# the jobs' pipelines first, for at most this long (a second or more of its core each): a first preview of a pipeline
# then costs what the next ones do. 0: none is planned before its first preview.
STATE_READER_WARM_PIPELINES_SECONDS = env_int("STATEKEEPER_STATE_READER_WARM_PIPELINES_SECONDS", 300)
# A migration's preview runs the new version's first batch on at most this many keys of the migrated state, beside
# the keys the batch reads (its output is the same; seeding a key costs about a millisecond on a busy host: the
# benchmarks). 0: on the whole state.
MIGRATION_PREVIEW_KEYS = env_int("STATEKEEPER_MIGRATION_PREVIEW_KEYS", 2000)
STATE_READER_SOCKET = Path(
    env_str(
        "STATEKEEPER_STATE_READER_SOCKET",
        # short (a socket's path has at most 107 bytes), private to the user, and one per checkout and Redis database
        f"{tempfile.gettempdir()}/statekeeper-{os.getuid()}/reader-"
        f"{hashlib.sha1(f'{BASE_DIR}|{REDIS_URL}'.encode()).hexdigest()[:12]}.sock",
    )
)
READ_ONLY = env_str("STATEKEEPER_READ_ONLY", "") in ("1", "true", "yes")
# Failed logins: after LOGIN_FAILURES_ALLOWED failures for a user name or from an address within LOGIN_LOCKOUT_SECONDS,
# further attempts are refused until that window has passed.
LOGIN_FAILURES_ALLOWED = env_int("STATEKEEPER_LOGIN_FAILURES", 5)
LOGIN_LOCKOUT_SECONDS = env_int("STATEKEEPER_LOGIN_LOCKOUT", 900)

# Raw checkpoint records are kept this long; beyond it only the per-minute and per-hour roll-ups remain.
CHECKPOINT_RAW_RETENTION_HOURS = env_int("STATEKEEPER_RAW_RETENTION_HOURS", 24)

# A results view that sets no bound of its own (ResultView.keep_rows / keep_hours) keeps the rows of its latest
# batches, this many at most, so that a pipeline whose results are per entity does not grow the table for good.
RESULTS_KEEP_ROWS = env_int("STATEKEEPER_RESULTS_KEEP_ROWS", 1_000_000)
if RESULTS_KEEP_ROWS < 1:
    raise ImproperlyConfigured(f"STATEKEEPER_RESULTS_KEEP_ROWS must be 1 or more, not {RESULTS_KEEP_ROWS}")

# Alerts: notified on open and on resolve. Empty webhook or no addresses: shown in the console only.
ALERT_WEBHOOK_URL = env_str("STATEKEEPER_ALERT_WEBHOOK", "")
ALERT_EMAILS = [a for a in env_str("STATEKEEPER_ALERT_EMAILS", "").split(",") if a]
ALERT_CHECKPOINT_STALL_TRIGGERS = env_int("STATEKEEPER_ALERT_STALL_TRIGGERS", 10)  # no commit for N x trigger
ALERT_RESTART_LOOP_COUNT = env_int("STATEKEEPER_ALERT_RESTARTS", 3)  # restarts within the job's failure window
ALERT_RESOLVE_AFTER_SECONDS = env_int("STATEKEEPER_ALERT_RESOLVE_AFTER", 20)  # clear this long before all-clear
ALERT_CLUSTER_WAIT_SECONDS = env_int("STATEKEEPER_ALERT_CLUSTER_WAIT", 120)  # a run waiting for cluster cores this long
# a running job's driver JVM whose heap, after a garbage collection, holds this share of its maximum: near an
# OutOfMemoryError, which in a shared driver fails every job in it
ALERT_DRIVER_HEAP_PERCENT = env_int("STATEKEEPER_ALERT_DRIVER_HEAP_PERCENT", 85)
if not 1 <= ALERT_DRIVER_HEAP_PERCENT <= 100:
    raise ImproperlyConfigured(
        f"STATEKEEPER_ALERT_DRIVER_HEAP_PERCENT must be 1 to 100, not {ALERT_DRIVER_HEAP_PERCENT}"
    )
CAPACITY_EMAILS = [a for a in env_str("STATEKEEPER_CAPACITY_EMAILS", "").split(",") if a]  # weekly review
CONSOLE_URL = env_str("STATEKEEPER_CONSOLE_URL", "http://127.0.0.1:8000")
DEFAULT_FROM_EMAIL = env_str("STATEKEEPER_FROM_EMAIL", "statekeeper@localhost")
EMAIL_BACKEND = env_str("STATEKEEPER_EMAIL_BACKEND", "django.core.mail.backends.filebased.EmailBackend")
EMAIL_FILE_PATH = str(BASE_DIR / "var" / "mail")
EMAIL_HOST = env_str("STATEKEEPER_SMTP_HOST", "localhost")
EMAIL_PORT = env_int("STATEKEEPER_SMTP_PORT", 25)

# Every process' lines carry their time (a takeover, a stop, a restart are read off the drivers' logs to the tenth of a
# second) and thread (a shared driver runs a thread per job). py4j's INFO is a line per call between Python and the JVM.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"timed": {"format": "%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "timed"}},
    "root": {"handlers": ["console"], "level": env_str("STATEKEEPER_LOG_LEVEL", "INFO")},
    "loggers": {"py4j": {"level": "WARNING"}},
}
