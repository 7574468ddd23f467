# Shared set-up for bin/dev and bin/test: a virtualenv with pinned packages, Java, Redis and PostgreSQL.
# Everything is idempotent: a second run checks and moves on.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
# A local run: the embedded defaults (a development secret key) are accepted only with this set.
export STATEKEEPER_ENV=${STATEKEEPER_ENV:-development}
export PGHOST=${PGHOST:-127.0.0.1} PGPORT=${PGPORT:-5432} PGUSER=${PGUSER:-postgres}

say() { printf '\033[1;34m==>\033[0m %s\n' "$*"; }

apt_install() {
  if ! command -v apt-get >/dev/null; then say "cannot install $*: no apt-get here"; return 1; fi
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  [ -n "${APT_UPDATED:-}" ] || { $sudo apt-get update -qq; APT_UPDATED=1; }
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

ensure_java() {
  local major=0
  if command -v java >/dev/null; then
    major=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
  fi
  if [ "${major:-0}" -lt 17 ]; then
    say "installing Java 17 (found ${major:-none})"
    apt_install openjdk-17-jdk-headless
  elif ! command -v javac >/dev/null; then  # its compiler builds the quiet local file system (workers/spark/quiet_files.py)
    say "installing the Java 17 compiler"
    apt_install openjdk-17-jdk-headless || say "no javac: Hadoop's local file system forks chmod for each file it writes"
  fi
}

package_stamp() { cat "$1/pyproject.toml"; grep -sh '^__version__' "$1"/*/__init__.py || true; }

ensure_venv() {
  if [ ! -x "$PY" ]; then
    say "creating the virtualenv in .venv"
    python3 -m venv "$VENV"
  fi
  if ! cmp -s requirements/lock.txt "$VENV/.installed" 2>/dev/null; then
    say "installing pinned packages (requirements/lock.txt)"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r requirements/lock.txt
    cp requirements/lock.txt "$VENV/.installed"
  fi
  # The console itself (editable: the code stays where it is).
  if ! package_stamp . | cmp -s - "$VENV/.console" 2>/dev/null; then
    say "installing the console"
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -e .
    package_stamp . > "$VENV/.console"
  fi
  # The pipeline SDK first (the console and every pipeline package import it), the `statekeeper` command (its own
  # distribution, as a team's CI installs it), then the example pipeline packages, installed like any user's package
  # (editable, so an edit takes effect). A package is installed again when its metadata changes: its pyproject.toml,
  # or a version its code declares.
  local example name
  for example in sdk/ cli/ examples/*/; do
    name=$(basename "$example")
    if ! package_stamp "$example" | cmp -s - "$VENV/.example-$name" 2>/dev/null; then
      say "installing the package $example"
      "$VENV/bin/pip" install -q --disable-pip-version-check -e "$example"
      package_stamp "$example" > "$VENV/.example-$name"
    fi
  done
}

redis_up() { "$PY" -c "import redis,sys; redis.Redis(host='127.0.0.1', port=6379, socket_connect_timeout=1).ping()" 2>/dev/null; }

ensure_redis() {
  redis_up && return 0
  command -v redis-server >/dev/null || { say "installing redis-server"; apt_install redis-server; }
  say "starting Redis on 127.0.0.1:6379"
  mkdir -p "$ROOT/var/redis"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no --dir "$ROOT/var/redis" \
    --logfile "$ROOT/var/redis/redis.log"
  for _ in $(seq 20); do redis_up && return 0; sleep 0.5; done
  echo "Redis did not start: see var/redis/redis.log" >&2; return 1
}

pg_up() { "$PY" -c "import psycopg; psycopg.connect('host=$PGHOST port=$PGPORT user=$PGUSER dbname=postgres', connect_timeout=2).close()" 2>/dev/null; }

ensure_postgres() {
  # Sets DATABASE_URL: PostgreSQL when it is reachable or can be started, otherwise SQLite.
  if [ -n "${DATABASE_URL:-}" ]; then return 0; fi
  if ! pg_up; then
    if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
      say "installing PostgreSQL"; apt_install postgresql || true
    fi
    if ls /etc/postgresql/*/main >/dev/null 2>&1; then
      say "starting PostgreSQL"
      pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start 2>/dev/null || true
      for _ in $(seq 20); do pg_up && break; sleep 0.5; done
      pg_up || su postgres -c "psql -c \"ALTER USER postgres PASSWORD NULL\"" >/dev/null 2>&1 || true
    fi
  fi
  if pg_up; then
    "$PY" - <<'PYEOF'
import os, psycopg
conn = psycopg.connect(f"host={os.environ['PGHOST']} port={os.environ['PGPORT']} user={os.environ['PGUSER']} dbname=postgres", autocommit=True)
for name in ("statekeeper", "team_orders"):  # the console's, and the demo team job's own (its sink's table)
    if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
        conn.execute(f"CREATE DATABASE {name}")
# the console updates its rows all day (results, undo records, jobs): without autovacuum every table grows with dead
# rows for good (seen on a machine whose server had it off)
if conn.execute("SHOW autovacuum").fetchone()[0] == "off":
    try:
        conn.execute("ALTER SYSTEM SET autovacuum = on")
        conn.execute("SELECT pg_reload_conf()")
        print("==> PostgreSQL's autovacuum was off: turned on (ALTER SYSTEM), or every table would grow with dead rows")
    except psycopg.Error as exc:
        print(f"==> PostgreSQL's autovacuum is off and could not be turned on ({exc}); the capacity review warns of it")
PYEOF
    export DATABASE_URL="postgres://$PGUSER@$PGHOST:$PGPORT/statekeeper"
  else
    say "PostgreSQL is not available: using SQLite (var/db.sqlite3)"
    mkdir -p "$ROOT/var"
    export DATABASE_URL="sqlite://$ROOT/var/db.sqlite3"
  fi
}

app_database_url() {
  # The same PostgreSQL database as the app role (STATEKEEPER_DB_APP_ROLE, STATEKEEPER_DB_APP_PASSWORD); SQLite as is.
  "$PY" - "$1" <<'PYEOF'
import os, sys
from urllib.parse import quote, urlsplit, urlunsplit
url = urlsplit(sys.argv[1])
if url.scheme.startswith("postgres"):
    user = quote(os.environ.get("STATEKEEPER_DB_APP_ROLE", "statekeeper_app"), safe="")
    password = os.environ.get("STATEKEEPER_DB_APP_PASSWORD", "")
    auth = user + (":" + quote(password, safe="") if password else "")
    print(urlunsplit(url._replace(netloc=f"{auth}@{url.hostname}" + (f":{url.port}" if url.port else ""))))
else:
    print(sys.argv[1])
PYEOF
}

ensure_chromium() {
  command -v chromium >/dev/null || { say "installing Debian's chromium (for browser tests)"; apt_install chromium; }
}

# The class archive every Spark JVM maps (workers/spark/class_archive.py): made once per JDK and pyspark, about half a
# minute; a JVM starts without it when it could not be made.
ensure_class_archive() {
  mkdir -p var
  local out
  if out=$("$PY" -m workers.spark.make_class_archive 2>>var/class-archive.log); then
    case "$out" in *"made before"*) ;; *) say "$out" ;; esac
  else
    say "no class archive (var/class-archive.log says why): JVMs start without it"
  fi
}
