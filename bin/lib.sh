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
PGPASS=${PGPASSFILE:-${XDG_CONFIG_HOME:-$HOME/.config}/statekeeper/pgpass}
# the password of the set-up's Kafka broker's SASL listener, kept beside the database's (one broker serves every
# checkout on this machine)
export STATEKEEPER_KAFKA_SASL_PASSWORD_FILE=${STATEKEEPER_KAFKA_SASL_PASSWORD_FILE:-${XDG_CONFIG_HOME:-$HOME/.config}/statekeeper/kafka-sasl-password}
export STATEKEEPER_KAFKA_TLS_DIR=${STATEKEEPER_KAFKA_TLS_DIR:-${XDG_CONFIG_HOME:-$HOME/.config}/statekeeper/kafka-tls}

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

# a command as the postgres system user, on the server's local socket (peer authentication: no password)
pg_local() {
  local command="env -u PGHOST -u PGPASSFILE PGPORT=$PGPORT $*"
  if [ "$(id -u)" -eq 0 ]; then su postgres -c "$command"; else sudo -u postgres sh -c "$command"; fi
}

pg_passwords() {
  # Debian's PostgreSQL asks TCP clients for a password (scram-sha-256). The set-up gives the superuser and the app role
  # a random password each, made once and kept in libpq's password file PGPASS (readable only by you; one per user,
  # as the server is one per machine: a second checkout finds the same), set through the server's local socket as the
  # postgres system user; every process finds them through PGPASSFILE, so no password stands in a DSN, a log or the
  # environment.
  local file="$PGPASS" role app="${STATEKEEPER_DB_APP_ROLE:-statekeeper_app}"
  if [ ! -s "$file" ]; then
    mkdir -p "$(dirname "$file")"
    ( umask 077
      for role in "$PGUSER" "$app"; do
        printf '*:*:*:%s:%s\n' "$role" "$("$PY" -c 'import secrets; print(secrets.token_hex(16))')"
      done > "$file" )
  fi
  export PGPASSFILE="$file"
  while IFS=: read -r _ _ _ role password; do
    pg_local "psql -q -v ON_ERROR_STOP=1 -d postgres" >/dev/null <<SQL || return 1
DO \$\$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$role') THEN CREATE ROLE "$role" LOGIN; END IF;
END \$\$;
ALTER ROLE "$role" PASSWORD '$password';
SQL
  done < "$file"
}

ensure_postgres() {
  # Sets DATABASE_URL to PostgreSQL, installing and starting the server when none answers. Never SQLite by itself:
  # only DATABASE_URL=sqlite://... chooses it.
  if [ -n "${DATABASE_URL:-}" ]; then return 0; fi
  [ -s "$PGPASS" ] && export PGPASSFILE="$PGPASS"
  if ! pg_up; then
    if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
      say "installing PostgreSQL"; apt_install postgresql || true
    fi
    if ls /etc/postgresql/*/main >/dev/null 2>&1; then
      if ! pg_local "pg_isready -q"; then
        say "starting PostgreSQL"
        pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -1)" main start 2>/dev/null || true
        for _ in $(seq 20); do pg_local "pg_isready -q" && break; sleep 0.5; done
      fi
      pg_up || { say "PostgreSQL asks for a password: setting the set-up's own ($PGPASS)"; pg_passwords || true; }
    fi
  fi
  if ! pg_up; then
    cat >&2 <<MSG
PostgreSQL cannot be reached at $PGHOST:$PGPORT as $PGUSER, and could not be installed, started or opened here.
Start it (or point PGHOST, PGPORT, PGUSER and PGPASSFILE at yours), or choose SQLite for a quick look with
DATABASE_URL=sqlite://$ROOT/var/db.sqlite3 (the test suite needs PostgreSQL).
MSG
    return 1
  fi
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

# Jars from Maven Central (requirements/maven/*.xml), each set fetched once into var/jars/SET with Maven's own cache in
# var/maven, checked against requirements/maven/jars.sha256, and reused offline from then on.
JARS="$ROOT/var/jars"

jars_checked() {  # the set's jars are all there and match their hashes
  local set=$1
  [ -d "$JARS/$set" ] || return 1
  grep " $set/" requirements/maven/jars.sha256 | (cd "$JARS" && sha256sum --quiet --strict -c -) >/dev/null 2>&1 || return 1
  [ "$(ls "$JARS/$set" | wc -l)" -eq "$(grep -c " $set/" requirements/maven/jars.sha256)" ]
}

fetch_jars() {  # Maven resolves the set's dependencies into var/jars/SET (the runtime scope: what runs)
  local set=$1
  command -v mvn >/dev/null || { say "installing Maven"; apt_install maven; }
  rm -rf "$JARS/$set"
  mvn -q -B -f "requirements/maven/$set.xml" dependency:copy-dependencies -DincludeScope=runtime \
    -DoutputDirectory="$JARS/$set" -Dmaven.repo.local="$ROOT/var/maven" >"$ROOT/var/maven.log" 2>&1
}

ensure_jars() {
  local set=$1
  jars_checked "$set" && return 0
  say "fetching the $set jars with Maven (requirements/maven/$set.xml)"
  if ! fetch_jars "$set"; then
    echo "Maven could not fetch the $set jars: see var/maven.log" >&2; return 1
  fi
  if ! jars_checked "$set"; then
    echo "The $set jars Maven fetched do not match requirements/maven/jars.sha256 (var/jars/$set):" >&2
    (cd "$JARS" && sha256sum "$set"/*.jar) | diff - <(grep " $set/" requirements/maven/jars.sha256 | sort -k2) >&2 || true
    return 1
  fi
}

# Spark's Kafka connector on every driver's class path, after a site's own jars (STATEKEEPER_SPARK_JARS).
ensure_spark_kafka() {
  ensure_jars spark-kafka || return 1
  local listed
  listed=$(ls "$JARS"/spark-kafka/*.jar | paste -sd, -)
  case ",${STATEKEEPER_SPARK_JARS:-}," in
    *"spark-sql-kafka"*) ;;
    ",,") export STATEKEEPER_SPARK_JARS="$listed" ;;
    *) export STATEKEEPER_SPARK_JARS="$STATEKEEPER_SPARK_JARS,$listed" ;;
  esac
}

KAFKA_DIR="$ROOT/var/kafka"
KAFKA_STARTED=""

kafka_up() { (exec 3<>"/dev/tcp/${1%:*}/${1##*:}") 2>/dev/null; }

ensure_kafka() {
  # STATEKEEPER_KAFKA_BOOTSTRAP names a site's own cluster; otherwise a one-node KRaft broker on 127.0.0.1:9092, started
  # here when none answers, its log under var/kafka. KAFKA_STARTED is set when this call started it (stop_kafka).
  if [ -n "${STATEKEEPER_KAFKA_BOOTSTRAP:-}" ]; then return 0; fi
  export STATEKEEPER_KAFKA_BOOTSTRAP=127.0.0.1:9092
  if kafka_up "$STATEKEEPER_KAFKA_BOOTSTRAP"; then
    # a broker this checkout started before the TLS listener existed is started again with it
    kafka_up 127.0.0.1:9095 || ! kill -0 "$(cat "$KAFKA_DIR/pid" 2>/dev/null)" 2>/dev/null && return 0
    say "restarting this checkout's Kafka broker, which has no TLS listener yet"
    KAFKA_STARTED=1 stop_kafka
  fi
  ensure_jars kafka-broker || return 1
  mkdir -p "$KAFKA_DIR/data"
  # A second listener on 9094 asks for SASL (PLAIN, the user statekeeper, its password made once and kept in
  # STATEKEEPER_KAFKA_SASL_PASSWORD_FILE): the tests read a topic through it as a cluster that needs a login is read.
  # A third, on 9095, asks for the same login over TLS (SASL_SSL), with a certificate for 127.0.0.1 signed by a CA the
  # set-up makes once (kafka_tls: STATEKEEPER_KAFKA_TLS_DIR/ca.pem is what a client trusts).
  local sasl=$STATEKEEPER_KAFKA_SASL_PASSWORD_FILE tls=$STATEKEEPER_KAFKA_TLS_DIR
  [ -s "$sasl" ] || (umask 077; mkdir -p "$(dirname "$sasl")"; "$PY" -c 'import secrets; print(secrets.token_urlsafe(18))' > "$sasl")
  kafka_tls "$tls" || return 1
  cat > "$KAFKA_DIR/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:9093
listeners=PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093,SASL_PLAINTEXT://127.0.0.1:9094,SASL_SSL://127.0.0.1:9095
advertised.listeners=PLAINTEXT://127.0.0.1:9092,SASL_PLAINTEXT://127.0.0.1:9094,SASL_SSL://127.0.0.1:9095
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,SASL_SSL:SASL_SSL
sasl.enabled.mechanisms=PLAIN
listener.name.sasl_plaintext.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_statekeeper="$(cat "$sasl")";
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_statekeeper="$(cat "$sasl")";
listener.name.sasl_ssl.ssl.keystore.type=PEM
listener.name.sasl_ssl.ssl.keystore.location=$tls/broker.pem
log.dirs=$KAFKA_DIR/data
num.partitions=3
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
group.initial.rebalance.delay.ms=0
log.retention.hours=24
PROPS
  chmod 600 "$KAFKA_DIR/server.properties"
  cat > "$KAFKA_DIR/log4j2.properties" <<PROPS
appender.file.type = File
appender.file.name = file
appender.file.fileName = $KAFKA_DIR/broker.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka.server.KafkaServer
logger.kafka.level = INFO
PROPS
  local java=(java -Xms128m -Xmx384m -XX:+UseG1GC -Dlog4j2.configurationFile="$KAFKA_DIR/log4j2.properties"
    -cp "$JARS/kafka-broker/*")
  if [ ! -f "$KAFKA_DIR/data/meta.properties" ]; then
    "${java[@]}" kafka.tools.StorageTool format --standalone -t "$("$PY" -c 'import uuid, base64; print(base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("="))')" \
      -c "$KAFKA_DIR/server.properties" >"$KAFKA_DIR/format.log" 2>&1 || { cat "$KAFKA_DIR/format.log" >&2; return 1; }
  fi
  say "starting Kafka on 127.0.0.1:9092 (log: var/kafka/broker.log)"
  nohup "${java[@]}" kafka.Kafka "$KAFKA_DIR/server.properties" >"$KAFKA_DIR/stdout.log" 2>&1 &
  echo $! > "$KAFKA_DIR/pid"
  for _ in $(seq 60); do
    if kafka_up "$STATEKEEPER_KAFKA_BOOTSTRAP"; then KAFKA_STARTED=1; return 0; fi
    kill -0 "$(cat "$KAFKA_DIR/pid")" 2>/dev/null || break
    sleep 0.5
  done
  echo "Kafka did not start: see var/kafka/broker.log and var/kafka/stdout.log" >&2; return 1
}

kafka_tls() {  # the set-up broker's TLS: a CA (ca.pem) and the broker's key and certificate for 127.0.0.1 (broker.pem)
  local dir=$1
  [ -s "$dir/ca.pem" ] && [ -s "$dir/broker.pem" ] && return 0
  (umask 077; mkdir -p "$dir"
   openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=Statekeeper set-up CA" \
     -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" 2>/dev/null &&
   openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout "$dir/broker-key.pem" -out "$dir/broker.csr" 2>/dev/null &&
   printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > "$dir/broker.ext" &&
   openssl x509 -req -in "$dir/broker.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" -CAcreateserial -days 3650 \
     -extfile "$dir/broker.ext" -out "$dir/broker-cert.pem" 2>/dev/null &&
   cat "$dir/broker-key.pem" "$dir/broker-cert.pem" > "$dir/broker.pem" &&
   chmod 644 "$dir/ca.pem") || { echo "could not make the Kafka broker's TLS certificate in $dir" >&2; rm -f "$dir/broker.pem"; return 1; }
}

stop_kafka() {  # the broker this run started, and only that one
  [ -n "$KAFKA_STARTED" ] && [ -f "$KAFKA_DIR/pid" ] || return 0
  local pid; pid=$(cat "$KAFKA_DIR/pid")
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$KAFKA_DIR/pid"
}

# The digest of the code the headline chaos runs guard (tests/headline-code lists it): ./bin/test compares it with
# tests/headline-passed, what those runs last passed on.
headline_digest() {
  (cd "$ROOT" && grep -v '^#' tests/headline-code | xargs sha256sum | sha256sum | cut -d' ' -f1)
}
