"""``statekeeper``: jobs as code from a shell or a CI pipeline, through the console's API with a token.

    statekeeper plan jobs/            what applying the specs would do (exit 0: nothing, 2: changes, 1: refused)
    statekeeper apply jobs/ [--prune] do it, action by action, each waited for (exit 0: applied, 1: stopped)
    statekeeper status [JOB]          jobs, their state and latest checkpoint
    statekeeper savepoint JOB         take a savepoint and wait for it to be verified
    statekeeper restore JOB ID        restore a savepoint (the job must be stopped)
    statekeeper rollback JOB BATCH    roll back to a retained batch (the job must be stopped)
    statekeeper logs JOB              the job's recent runs and actions, with their messages
    statekeeper results JOB [VIEW]    the job's results: each view and its rows, or a view's rows in key order
    statekeeper dead-letters JOB      the job's dead letters, newest first, with the reason each was refused
    statekeeper redrive JOB ID...     re-drive dead letters (or --all) into the job's source once the cause is fixed
    statekeeper secrets               the secrets the console keeps: names, versions, the jobs that name them
    statekeeper secret set NAME       set or rotate a secret (admin), its value read from standard input
    statekeeper secret delete NAME    delete a secret no job names (admin)

A spec is a YAML or TOML file per job (a directory of them, or one file): the job's settings by name, ``state:
running | suspended`` and ``upgrade_mode: savepoint | stateless | migrate |
blue-green``. A spec never holds a password: a parameter
names a secret instead (``postgres://team:${secret:team-db-password}@db/team_orders``), set once with ``statekeeper
secret set``. ``--prune``: a job made from specs that no file
names any more is archived. ``--json`` (before or after the command) prints machine-readable output on stdout. The console's address and token come from
``--url``/``--token`` or STATEKEEPER_URL/STATEKEEPER_TOKEN (``manage.py create_token`` makes one).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

NOTHING, CHANGES, FAILED = 0, 2, 1


class ApiFailure(Exception):
    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.body = status, body


class Console:
    def __init__(self, url: str, token: str, timeout: float = 30) -> None:
        self.url, self.token, self.timeout = url.rstrip("/"), token, timeout

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}/api/v1/{path.lstrip('/')}", data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Content-Type", "application/json")
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = {"error": raw[:300].decode("utf-8", "replace")}
            raise ApiFailure(exc.code, str(payload.get("error", "")), payload) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise ApiFailure(0, f"the console at {self.url} cannot be reached: {exc}") from None

    def wait(self, action: dict[str, Any], timeout: float, say: Any) -> dict[str, Any]:
        """Poll an action until it succeeds or fails (or ``timeout``)."""
        deadline, shown = time.monotonic() + timeout, ""
        while True:
            action = self.call("GET", f"actions/{action['id']}")
            if action["status"] in ("succeeded", "failed", "aborted"):
                return action
            if action.get("progress") and action["progress"] != shown:
                shown = action["progress"]
                say(f"    … {shown}")
            if time.monotonic() > deadline:
                raise ApiFailure(0, f"action #{action['id']} did not finish in {timeout:.0f} s (it goes on)")
            time.sleep(1)


def seg(value: Any) -> str:
    """One path segment of the API's URL, quoted: a job or secret name never reaches the query or another path."""
    return urllib.parse.quote(str(value), safe="")


class BadInput(Exception):
    """Input the CLI cannot use (a spec file, a name): one sentence, no request made."""


def read_specs(path: Path) -> list[dict[str, Any]]:
    """Every spec under ``path`` (a file, or the *.yaml, *.yml and *.toml files of a directory), each naming its job
    (the file's stem when it does not). BadInput says what is wrong with a file, with its name."""
    try:
        files = (
            [path] if path.is_file()
            else sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".toml"))
        )  # fmt: skip
    except OSError as exc:
        raise BadInput(f"{path}: {exc.strerror or exc}") from None
    specs = []
    for file in files:
        kind = "TOML" if file.suffix == ".toml" else "YAML"
        try:
            text = file.read_text(encoding="utf-8")
            spec = tomllib.loads(text) if file.suffix == ".toml" else yaml.safe_load(text)
        except OSError as exc:
            raise BadInput(f"{file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise BadInput(f"{file}: not UTF-8 text (byte {exc.start})") from None
        except RecursionError:
            raise BadInput(f"{file}: nested too deeply to be a job's spec") from None
        except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
            raise BadInput(f"{file}: not valid {kind}: {exc}") from None
        if not isinstance(spec, dict):
            raise BadInput(f"{file}: a spec is a mapping of a job's settings")
        try:
            json.dumps(spec, allow_nan=False)
        except (TypeError, ValueError) as exc:  # a date, a time, binary or an infinity: JSON carries none
            raise BadInput(f"{file}: holds a value a job's spec cannot carry ({exc}); write it as a string") from None
        except RecursionError:
            raise BadInput(f"{file}: nested too deeply to be a job's spec") from None
        spec.setdefault("name", file.stem)
        specs.append(spec)
    return specs


def preview_verdict(console: Console, job: str, step: dict[str, Any], say: Any, timeout: float) -> dict[str, Any]:
    """The upgrade's compatibility, from the console's preview on the job's state (a read-only action)."""
    body = {k: v for k, v in step["params"].items() if k in ("pipeline", "parameters")}
    migrate = step["params"].get("upgrade_mode") == "migrate"
    if migrate:
        body["migrate"] = 1  # the preview runs the migration and the new version's first batch on a scratch copy
    try:
        requested = console.call("POST", f"jobs/{seg(job)}/upgrade-preview", body)["action"]
    except ApiFailure as exc:
        return {"verdict": "refused", "summary": str(exc.body.get("error") if exc.body else exc)}
    done = console.wait(requested, timeout, say)
    plan = (done.get("params") or {}).get("plan") or {}
    if done["status"] != "succeeded" or not plan:
        return {"verdict": "refused", "summary": done.get("outcome") or "the preview failed"}
    if migrate:
        return {"verdict": "migrated", "summary": f"{plan.get('summary', '')}. {done.get('outcome', '')}"}
    if plan.get("incompatible"):
        if step["params"].get("upgrade_mode") == "stateless":
            return {"verdict": "empty state", "summary": plan.get("summary", "")}
        return {"verdict": "refused", "summary": plan.get("summary", "")}
    return {"verdict": "compatible", "summary": plan.get("summary", "")}


def planned(console: Console, specs: list[dict[str, Any]], prune: bool, say: Any, timeout: float) -> list[dict]:
    jobs = console.call("POST", "plan", {"jobs": specs, "prune": prune})["jobs"]
    for job in jobs:
        for step in job["steps"]:
            if step["action"] == "upgrade" or step["action"] == "blue-green" and "pipeline" in step["params"]:
                step["verdict"] = preview_verdict(console, job["name"], step, say, timeout)
                if step["verdict"]["verdict"] == "refused":
                    job["change"] = "refused"
                    job["refusal"] = f"the upgrade is refused: {step['verdict']['summary']}"
    return jobs


def show_plan(jobs: list[dict[str, Any]], say: Any) -> None:
    for job in jobs:
        say(f"{job['name']}: {job['change']}" + (f" ({job['refusal']})" if job.get("refusal") else ""))
        for step in job["steps"]:
            params = {k: v for k, v in step["params"].items() if k != "spec"} or step["params"].get("spec") or ""
            verdict = step.get("verdict")
            line = f"  - {step['action']} {json.dumps(params, default=str) if params else ''}".rstrip()
            if verdict:
                line += f" → {verdict['verdict']}: {verdict['summary']}"
            if step.get("why"):
                line += f" ({step['why']})"
            say(line)


def apply_step(console: Console, job: str, step: dict[str, Any], say: Any, timeout: float) -> str:
    """Run one step as the console's audited action and wait for it; returns its outcome, raises on failure."""
    action, params = step["action"], step["params"]
    if action == "create":
        console.call("POST", "jobs", {**params["spec"], "state": "suspended"})
        return "created"
    if action == "update":
        tag = console.call("GET", f"jobs/{seg(job)}")["etag"]
        console.call("PATCH", f"jobs/{seg(job)}", params["spec"], {"If-Match": tag})
        return "settings changed"
    if action == "archive":
        result = console.call("DELETE", f"jobs/{seg(job)}")
        return "archived" + (f" (stopping with action #{result['action']['id']})" if "action" in result else "")
    if action == "start":
        run = console.call("POST", f"jobs/{seg(job)}/start")["run"]
        return wait_running(console, job, run["id"], timeout)
    body = dict(params)
    if action in ("upgrade", "rescale", "blue-green"):
        body["from_spec"] = 1  # the settings it makes become the job's applied spec
    if action == "upgrade":
        mode = body.pop("upgrade_mode", "savepoint")
        if mode == "stateless" and (step.get("verdict") or {}).get("verdict") == "empty state":
            body["empty_state"] = 1
        if mode == "migrate":
            body["migrate"] = 1
    requested = console.call("POST", f"jobs/{seg(job)}/{action}", body)["action"]
    done = console.wait(requested, timeout, say)
    if done["status"] != "succeeded":
        raise ApiFailure(0, f"{action} #{done['id']} failed: {done['outcome']}")
    return done["outcome"]


def wait_running(console: Console, job: str, run_id: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = console.call("GET", f"jobs/{seg(job)}/runs?limit=5")["runs"]
        run = next((r for r in runs if r["id"] == run_id), None)
        if run and run["status"] == "running":
            return f"run #{run_id} running"
        if run and run["status"] in ("failed", "refused", "lost", "stopped"):
            raise ApiFailure(0, f"run #{run_id} {run['status']}: {run.get('message') or ''}")
        time.sleep(1)
    raise ApiFailure(0, f"run #{run_id} was not running after {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statekeeper", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("STATEKEEPER_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--token", default=os.environ.get("STATEKEEPER_TOKEN", ""))
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for each action")
    # --json and --timeout also after the command (`statekeeper status --json`): SUPPRESS keeps the value given first
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    common.add_argument("--timeout", type=float, default=argparse.SUPPRESS, help="seconds to wait for each action")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, parents=[common])

    for name in ("plan", "apply"):
        planning = command(name)
        planning.add_argument("path", type=Path)
        planning.add_argument("--prune", action="store_true", help="archive spec-made jobs no file names any more")
    command("status").add_argument("job", nargs="?")
    command("savepoint").add_argument("job")
    restore = command("restore")
    restore.add_argument("job")
    restore.add_argument("savepoint", type=int)
    rollback = command("rollback")
    rollback.add_argument("job")
    rollback.add_argument("batch", type=int, help="a committed batch the job retains: it resumes after it")
    command("logs").add_argument("job")
    results = command("results")
    results.add_argument("job")
    results.add_argument("view", nargs="?", help="a view's kind; without it, each view and its rows")
    results.add_argument("--after", default="", help="the key to read on from (next_after of a page)")
    results.add_argument("--limit", type=int, default=100)
    letters = command("dead-letters")
    letters.add_argument("job")
    letters.add_argument("--before", default="", help="the id to read older letters from (next_before of a page)")
    letters.add_argument("--limit", type=int, default=50)
    redrive = command("redrive")
    redrive.add_argument("job")
    redrive.add_argument("ids", nargs="*", help="dead letters' ids (from dead-letters)")
    redrive.add_argument("--all", action="store_true", help="every dead letter of the job")
    command("secrets")
    secret = command("secret")
    secret.add_argument("verb", choices=("set", "delete"))
    secret.add_argument("name")
    args = parser.parse_args(argv)
    if not args.token:
        print("statekeeper: no token (--token or STATEKEEPER_TOKEN)", file=sys.stderr)
        return FAILED
    if not args.token.isascii() or not args.token.isprintable() or " " in args.token.strip():
        print(
            "statekeeper: the token is malformed: it is one word of printable ASCII, as `manage.py create_token` "
            "prints it (was the whole sentence captured?)",
            file=sys.stderr,
        )
        return FAILED
    console = Console(args.url, args.token.strip())
    # in --json mode the human lines go to stderr, and stdout holds one JSON document
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    try:
        return run(console, args, say)
    except BadInput as exc:
        print(f"statekeeper: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(exc), "status": 0}))
        return FAILED
    except ApiFailure as exc:
        print(f"statekeeper: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(exc), "status": exc.status}))
        return FAILED


def run(console: Console, args: argparse.Namespace, say: Any) -> int:
    out = (lambda value: print(json.dumps(value, indent=1, default=str))) if args.json else None
    if args.command in ("plan", "apply"):
        specs = read_specs(args.path)
        jobs = planned(console, specs, args.prune, say, args.timeout)
        show_plan(jobs, say)
        refused = [j for j in jobs if j["change"] == "refused"]
        if args.command == "plan" or refused:
            if out:
                out({"jobs": jobs})
            if refused:
                say(f"refused: {', '.join(j['name'] for j in refused)}; nothing applied")
                return FAILED
            return CHANGES if any(j["steps"] for j in jobs) else NOTHING
        report = []
        for job in jobs:
            for step in job["steps"]:
                say(f"{job['name']}: {step['action']} …")
                try:
                    outcome = apply_step(console, job["name"], step, say, args.timeout)
                except ApiFailure as exc:
                    report.append({"job": job["name"], "action": step["action"], "ok": False, "outcome": str(exc)})
                    say(f"{job['name']}: {step['action']} FAILED: {exc}; the apply stops here")
                    if out:
                        out({"applied": report})
                    return FAILED
                report.append({"job": job["name"], "action": step["action"], "ok": True, "outcome": outcome})
                say(f"{job['name']}: {step['action']}: {outcome}")
        if out:
            out({"applied": report})
        return NOTHING
    if args.command == "status":
        jobs = [console.call("GET", f"jobs/{seg(args.job)}")] if args.job else console.call("GET", "jobs")["jobs"]
        if out:
            out({"jobs": jobs})
        for job in jobs:
            latest = job.get("latest_checkpoint") or {}
            driver = job.get("driver") or {}
            where = f", driver pid {driver['pid']} on {driver['host']}" if driver.get("pid") else ""
            if driver.get("process_alive") and job["status"] not in ("running", "starting", "stopping", "pending"):
                where += " (still exiting)"
            say(f"{job['name']}: {job['status']}, {job['pipeline']}, batch {latest.get('batch_id', '—')}{where}"
                + (f", drift: {'; '.join(job['drift'])}" if job.get("drift") else ""))  # fmt: skip
        return NOTHING
    if args.command == "redrive" and bool(args.ids) == args.all:
        print("statekeeper: give the dead letters' ids, or --all", file=sys.stderr)
        return FAILED
    if args.command in ("savepoint", "restore", "rollback", "redrive"):
        bodies = {
            "restore": {"savepoint": getattr(args, "savepoint", 0)},
            "rollback": {"batch": getattr(args, "batch", 0)},
            "redrive": {"all": 1} if getattr(args, "all", False) else {"ids": getattr(args, "ids", [])},
        }
        body = bodies.get(args.command, {})
        path = "redrive-dead-letters" if args.command == "redrive" else args.command
        done = console.wait(console.call("POST", f"jobs/{seg(args.job)}/{path}", body)["action"], args.timeout, say)
        if out:
            out(done)
        say(f"{args.command} #{done['id']} {done['status']}: {done['outcome']}")
        return NOTHING if done["status"] == "succeeded" else FAILED
    if args.command in ("secrets", "secret"):
        return secrets(console, args, say, out)
    if args.command in ("results", "dead-letters"):
        return pages(console, args, say, out)
    runs = console.call("GET", f"jobs/{seg(args.job)}/runs?limit=10")["runs"]
    actions = console.call("GET", f"jobs/{seg(args.job)}/actions?limit=10")["actions"]
    if out:
        out({"runs": runs, "actions": actions})
    for r in runs:
        say(f"run #{r['id']} {r['status']} {r.get('started_at') or ''} {r.get('message') or ''}".rstrip())
    for a in actions:
        say(f"action #{a['id']} {a['kind']} {a['status']}: {a['outcome'] or a['progress'] or ''}".rstrip())
    return NOTHING


def pages(console: Console, args: argparse.Namespace, say: Any, out: Any) -> int:
    """A page of a job's results (a view's rows in key order, or the views) or of its dead letters (newest first)."""
    query = {"limit": args.limit}
    if args.command == "results":
        query |= {"view": args.view or "", "after": args.after}
        path = "results"
    else:
        query |= {"before": args.before}
        path = "dead-letters"
    found = console.call(
        "GET", f"jobs/{seg(args.job)}/{path}?{urllib.parse.urlencode({k: v for k, v in query.items() if v})}"
    )
    if out:
        out(found)
    elif args.command == "results" and "views" in found:
        for view in found["views"]:
            kept = view.get("kept") or {}
            bound = ", ".join(f"{k} {v}" for k, v in kept.items() if v)
            say(f"{view['view']}: {view['rows']} rows" + (f" (keeps {bound})" if bound else ""))
    elif args.command == "results":
        for row in found["results"]:
            say(f"{row['key']}\t{json.dumps(row['value'], sort_keys=True)}\tbatch {row['batch_id']}")
        if found.get("next_after"):
            say(f"more: --after {found['next_after']}")
    else:
        say(f"{found['total']} dead letters")
        for letter in found["dead_letters"]:
            payload = letter.get("payload", letter.get("payload_base64", ""))
            say(f"{letter['id']}  entry {letter['entry']}  {letter['stage']}: {letter['reason']}  {payload[:80]}")
        if found.get("next_before"):
            say(f"more: --before {found['next_before']}")
        if found["dead_letters"]:
            say(f"once fixed: statekeeper redrive {args.job} ID... (or --all)")
    return NOTHING


def secrets(console: Console, args: argparse.Namespace, say: Any, out: Any) -> int:
    """List the secrets, or set, rotate or delete one. A value comes from standard input, never from the command line
    (which any user of the machine can read in the process list)."""
    if args.command == "secrets":
        found = console.call("GET", "secrets")["secrets"]
        if out:
            out({"secrets": found})
        for s in found:
            pending = f"; {', '.join(s['pending_restart'])} on an older version" if s["pending_restart"] else ""
            say(f"{s['name']}: version {s['version']}, named by {', '.join(s['jobs']) or 'no job'}{pending}")
        return NOTHING
    if args.verb == "delete":
        result = console.call("DELETE", f"secrets/{seg(args.name)}")
        if out:
            out(result)
        say(f"deleted {args.name}")
        return NOTHING
    prompt = f"value of {args.name}: "
    value = getpass.getpass(prompt) if sys.stdin.isatty() else sys.stdin.read().removesuffix("\n")
    if not value:
        print("statekeeper: no value on standard input", file=sys.stderr)
        return FAILED
    result = console.call("PUT", f"secrets/{seg(args.name)}", {"value": value})
    if out:
        out(result)
    s = result["secret"]
    say(f"{s['name']}: version {s['version']}" + (f" ({result['note']})" if result.get("note") else ""))
    return NOTHING


if __name__ == "__main__":
    sys.exit(main())
