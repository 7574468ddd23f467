"""The API's OpenAPI 3.0 schema, served at /api/openapi.json (public: it describes, it discloses no data)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, JsonResponse

from dashboard.api.views import BODIES
from dashboard.records import MEASURES

NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[a-z0-9-]{1,63}$"}}
LIMIT = {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 500}}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
STAMP = {"type": "string", "format": "date-time", "nullable": True}

JSON_TYPES = {"ms": "integer", "bytes": "integer", "rows": "integer", "records": "integer", "rows/s": "number"}
CHECKPOINT = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "batch_id": {"type": "integer"},
        "location": {"type": "string"},
        "committed_at": STAMP,
        "kind": {"type": "string", "enum": ["full", "incremental"]},
        "end_offset": {"nullable": True},
        **{
            m.column: {"type": JSON_TYPES[m.unit], "nullable": True, "description": f"{m.label} ({m.unit})"}
            for m in MEASURES
            if m.column
        },
    },
}
JOB = {
    "type": "object",
    "required": ["name", "status"],
    "properties": {
        "name": {"type": "string"},
        "pipeline": {"type": "string"},
        "parameters": {
            "type": "object",
            "description": "the values the job sets; the pipeline's defaults fill the rest",
        },
        "source_stream": {"type": "string"},
        "state_backend": {"type": "string"},
        "trigger_interval_seconds": {"type": "number"},
        "parallelism": {"type": "integer"},
        "state_partitions": {"type": "integer"},
        "status": {"type": "string"},
        "checkpoint_dir": {"type": "string"},
        "latest_checkpoint": {"allOf": [{"$ref": "#/components/schemas/Checkpoint"}], "nullable": True},
        "open_alerts": {"type": "integer"},
        "driver": {
            "type": "object",
            "nullable": True,
            "description": "the latest run's driver: run, pid, host, shared_driver and process_alive (as on a Run)",
        },
    },
}
RUN = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "status": {"type": "string"},
        "requested_at": STAMP,
        "started_at": STAMP,
        "ended_at": STAMP,
        "message": {"type": "string"},
        "heap_after_gc_bytes": {
            "type": "integer",
            "nullable": True,
            "description": "its driver JVM's heap after the latest garbage collection, at the last heartbeat",
        },
        "heap_max_bytes": {"type": "integer", "nullable": True, "description": "its driver JVM's maximum heap"},
        "pid": {"type": "integer", "nullable": True, "description": "its driver's process id"},
        "host": {"type": "string", "description": "the host its driver runs on"},
        "shared_driver": {"type": "integer", "nullable": True, "description": "the shared driver that runs it, if any"},
        "process_alive": {
            "type": "boolean",
            "nullable": True,
            "description": "its driver process is still alive (an ended run's driver may take seconds to exit; a "
            "restore or rollback waits for it); null when it runs on another host",
        },
    },
}
SAVEPOINT = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "status": {"type": "string"},
        "origin": {"type": "string"},
        "batch_id": {"type": "integer", "nullable": True},
        "size_bytes": {"type": "integer"},
        "duration_ms": {"type": "integer"},
        "created_at": STAMP,
        "verified_at": STAMP,
        "error": {"type": "string"},
    },
}
ACTION = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "job": {"type": "string"},
        "kind": {"type": "string"},
        "status": {"type": "string"},
        "origin": {"type": "string"},
        "params": {"type": "object"},
        "requested_at": STAMP,
        "finished_at": STAMP,
        "progress": {"type": "string"},
        "outcome": {"type": "string"},
        "step": {"type": "string", "description": "the step it is at (or ended at)"},
        "phases": {
            "type": "array",
            "description": "every step it went through, with its duration (the open one: so far)",
            "items": {
                "type": "object",
                "properties": {
                    "step": {"type": "string"},
                    "label": {"type": "string"},
                    "seconds": {"type": "number"},
                    "open": {"type": "boolean"},
                },
            },
        },
        "proof": {
            "type": "object",
            "description": "an upgrade's watch of its new version: state unproven, proven, failed or stopped",
        },
    },
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ERRORS = {
    "401": _json(ERROR, "no or an unknown token"),
    "403": _json(ERROR, "the token's user lacks the role, or the console is read-only"),
    "404": _json(ERROR, "no such job"),
}


def _read(summary: str, body: dict[str, Any], params: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "parameters": params or [],
            "responses": {"200": _json(body, "OK"), **ERRORS, "400": _json(ERROR, "a bad query parameter")},
        }
    }


def _write(verb: str, summary: str, result: str) -> dict[str, Any]:
    fields = BODIES[verb]
    body = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            name: {"type": "string", "minLength": lo, "maxLength": hi}
            if kind is str
            else {"type": "object", "maxProperties": hi, "description": "the pipeline's parameter values (name: value)"}
            if kind is dict
            else {
                "type": "array",
                "minItems": lo,
                "maxItems": hi,
                "items": {"type": "string", "pattern": "^[0-9]{1,20}-[0-9]{1,20}$"},
            }
            if kind is list
            else {"type": "integer", "minimum": lo, "maximum": hi}
            for name, (kind, lo, hi, _) in fields.items()
        },
        "required": [name for name, (_, _, _, required) in fields.items() if required],
    }
    if verb in ("rescale", "redrive-dead-letters", "blue-green"):
        body["minProperties"] = 1
    return {
        "post": {
            "summary": summary,
            "parameters": [
                NAME,
                {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "schema": {"type": "string", "maxLength": 200},
                    "description": "a retried request with the same key returns the first answer and acts once",
                },
            ],
            "requestBody": {"required": bool(body["required"]), "content": {"application/json": {"schema": body}}},
            "responses": {
                "202": _json({"type": "object", "properties": {result: _ref(result.title())}}, "accepted"),
                "400": _json(ERROR, "a bad body"),
                "409": _json(ERROR, "refused: already running, an action in flight, or a preview's refusal"),
                "422": _json(ERROR, "the Idempotency-Key was used for a different request"),
                **ERRORS,
            },
        }
    }


def _green(summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "parameters": [NAME],
            "responses": {
                "200": _json(
                    {
                        "type": "object",
                        "properties": {
                            "action": {"type": "integer"},
                            "requested": {"type": "string"},
                            "green_up": {
                                "type": "boolean",
                                "description": "false: asked before the new version is up; "
                                "kept, and done once it follows the job",
                            },
                        },
                    },
                    "asked (before green is up too: kept until it follows)",
                ),  # fmt: skip
                "409": _json(ERROR, "the blue/green upgrade has ended, or it has handed over already"),
                **ERRORS,
            },
        }
    }


SPEC = {
    "type": "object",
    "description": "a job's spec: its settings by field name (as GET /api/v1/jobs/{name} shows them in spec), "
    "validated exactly as the job form validates them",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9-]{0,62}$"},
        "pipeline": {"type": "string"},
        "parameters": {"type": "object"},
        "source_stream": {"type": "string"},
        "state_backend": {"type": "string"},
        "parallelism": {"type": "integer"},
        "state_partitions": {"type": "integer"},
        "trigger_interval_seconds": {"type": "number"},
        "standby": {"type": "boolean"},
        "real_time": {"type": "boolean", "description": "run the query in Spark's real-time mode (a Kafka source)"},
        "state": {"type": "string", "enum": ["running", "suspended"], "description": "create only: start it or not"},
    },
}
REFUSED = _json(
    {"type": "object", "properties": {"error": {"type": "string"}, "problems": {"type": "object"}}},
    "the spec is refused: problems holds each setting's reasons",
)


def _jobs_as_code(paths: dict[str, Any]) -> None:
    """Create, change and archive jobs, and plan a set of specs (jobs as code)."""
    created = {"type": "object", "properties": {"job": _ref("Job"), "run": _ref("Run")}}
    paths["/api/v1/jobs"]["post"] = {
        "summary": "Create a job from a spec (admin); state running starts it",
        "requestBody": {"required": True, "content": {"application/json": {"schema": SPEC}}},
        "responses": {"201": _json(created, "created; ETag and Location headers"), "400": REFUSED, **ERRORS},
    }
    match = {"name": "If-Match", "in": "header", "schema": {"type": "string"}, "description": "the job's ETag"}
    paths["/api/v1/jobs/{name}"]["patch"] = {
        "summary": "Change the job's settings (admin), with If-Match: its ETag",
        "parameters": [NAME, match],
        "requestBody": {"required": True, "content": {"application/json": {"schema": SPEC}}},
        "responses": {
            "200": _json({"type": "object", "properties": {"job": _ref("Job")}}, "changed; the new ETag"),
            "400": REFUSED,
            "412": _json(ERROR, "the job changed since that ETag"),
            "428": _json(ERROR, "no If-Match"),
            **ERRORS,
        },
    }
    paths["/api/v1/jobs/{name}"]["delete"] = {
        "summary": "Archive the job (admin): stop it with a savepoint, keep its state and history, list it no more; "
        "free_name=true on an archived, stopped job frees its name (the job is renamed, its files moving with it)",
        "parameters": [NAME, {"name": "free_name", "in": "query", "schema": {"type": "string", "enum": ["true"]}}],
        "responses": {
            "200": _json({"type": "object"}, "archived"),
            "202": _json({"type": "object", "properties": {"action": _ref("Action")}}, "archived; stopping"),
            "409": _json(ERROR, "an action is in flight; or, to free a name, the job is not archived or still stops"),
            **ERRORS,
        },
    }
    plan_body = {
        "type": "object",
        "required": ["jobs"],
        "properties": {"jobs": {"type": "array", "maxItems": 500, "items": SPEC}, "prune": {"type": "boolean"}},
    }
    paths["/api/v1/plan"] = {
        "post": {
            "summary": "What applying these specs would do, job by job, with the actions it takes; changes nothing",
            "requestBody": {"required": True, "content": {"application/json": {"schema": plan_body}}},
            "responses": {"200": _json({"type": "object"}, "the plan"), "400": _json(ERROR, "a bad body"), **ERRORS},
        }
    }


SECRET = {
    "type": "object",
    "description": "a secret's name and version, and the jobs that name it: never its value",
    "properties": {
        "name": {"type": "string"},
        "version": {"type": "integer"},
        "created_at": STAMP,
        "created_by": {"type": "string"},
        "rotated_at": STAMP,
        "rotated_by": {"type": "string"},
        "jobs": {"type": "array", "items": {"type": "string"}},
        "pending_restart": {"type": "array", "items": {"type": "string"}, "description": "running jobs on an older "
                            "version: the rotation reaches them at their next start or upgrade"},
        "readable": {"type": "boolean", "description": "false: no key of STATEKEEPER_SECRETS_KEY decrypts it (the key "
                     "it was set with is gone); a job naming it cannot start"},
    },
}  # fmt: skip


def _secrets(paths: dict[str, Any]) -> None:
    """Secrets for the jobs' sinks: a parameter names one as ${secret:NAME}; only an admin sets one."""
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 63}}
    one = {"type": "object", "properties": {"secret": _ref("Secret"), "note": {"type": "string"}}}
    paths["/api/v1/secrets"] = _read(
        "Every secret's name and version, and the jobs that name it (never a value)",
        {"type": "object", "properties": {"secrets": {"type": "array", "items": _ref("Secret")}}},
    )
    paths["/api/v1/secrets/{name}"] = _read("One secret's name and version (never its value)", one, [name])
    value = {"type": "object", "required": ["value"], "additionalProperties": False,
             "properties": {"value": {"type": "string", "minLength": 1, "maxLength": 10000}}}  # fmt: skip
    paths["/api/v1/secrets/{name}"]["put"] = {
        "summary": "Set (201) or rotate (200) a secret (admin); a rotation reaches a job at its next start or upgrade",
        "parameters": [name],
        "requestBody": {"required": True, "content": {"application/json": {"schema": value}}},
        "responses": {"200": _json(one, "rotated"), "201": _json(one, "created"), "400": _json(ERROR, "refused"),
                      **ERRORS},
    }  # fmt: skip
    paths["/api/v1/secrets/{name}"]["delete"] = {
        "summary": "Delete a secret no job names (admin)",
        "parameters": [name],
        "responses": {"200": _json({"type": "object"}, "deleted"), "409": _json(ERROR, "jobs still name it"),
                      **ERRORS},
    }  # fmt: skip


def _checkpoint_decision(paths: dict[str, Any]) -> None:
    """A checkpoint the console never recorded: adopted, or set aside (its start is refused until then)."""
    body = {"type": "object", "required": ["decision"], "additionalProperties": False,
            "properties": {"decision": {"type": "string", "enum": ["adopt", "set-aside"]}}}  # fmt: skip
    paths["/api/v1/jobs/{name}/checkpoint-decision"] = {
        "post": {
            "summary": "Adopt a checkpoint this console never recorded (its history imported from its journals), or "
            "set it aside and start from nothing (operator)",
            "parameters": [NAME],
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": _json({"type": "object", "properties": {"outcome": {"type": "string"}}}, "done"),
                "400": _json(ERROR, "not a decision"),
                "409": _json(ERROR, "the checkpoint is the console's own, or a driver of the job is alive"),
                **ERRORS,
            },
        }
    }


def schema() -> dict[str, Any]:
    def list_of(key: str, item: str) -> dict[str, Any]:
        return {"type": "object", "properties": {key: {"type": "array", "items": _ref(item)}}}

    checkpoints = list_of("checkpoints", "Checkpoint")
    summary = {"type": "object", "properties": {"checkpoints": {"type": "integer"}, "rows": {"type": "array"}}}
    checkpoints["properties"] = {
        **checkpoints["properties"],
        "next_before": {"type": "integer", "nullable": True},
        "summary": summary,
    }
    before = {"name": "before", "in": "query", "schema": {"type": "integer", "minimum": 1}}
    action_id = {"name": "action_id", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 1}}
    paths = {
        "/api/v1/jobs": _read("All jobs with their status and latest checkpoint", list_of("jobs", "Job")),
        "/api/v1/jobs/{name}": _read("One job, with its checkpoint summary", _ref("Job"), [NAME]),
        "/api/v1/jobs/{name}/runs": _read("The job's runs, newest first", list_of("runs", "Run"), [NAME, LIMIT]),
        "/api/v1/jobs/{name}/checkpoints": _read(
            "Checkpoints, newest commit first; pass next_before as before for the next page",
            checkpoints,
            [NAME, LIMIT, before],
        ),
        "/api/v1/jobs/{name}/savepoints": _read("The job's savepoints", list_of("savepoints", "Savepoint"), [NAME]),
        "/api/v1/jobs/{name}/results": _read(
            "The job's results table: without view, each view, its rows and what it keeps (kept: the newest rows, "
            "hours since a row was last written; null where unbounded); with view, a page of it in key order "
            "(next_after as after for the next page)",
            {
                "type": "object",
                "properties": {
                    "views": {"type": "array", "items": {"type": "object"}},
                    "view": {"type": "string"},
                    "results": {"type": "array", "items": {"type": "object"}},
                    "next_after": {"type": "string", "nullable": True},
                },
            },
            [
                NAME,
                LIMIT,
                {"name": "view", "in": "query", "schema": {"type": "string", "maxLength": 40}},
                {"name": "after", "in": "query", "schema": {"type": "string", "maxLength": 500}},
            ],
        ),  # fmt: skip
        "/api/v1/jobs/{name}/actions": _read("The job's actions", list_of("actions", "Action"), [NAME, LIMIT]),
        "/api/v1/actions/{action_id}": _read(
            "One action: poll it until it succeeds or fails", _ref("Action"), [action_id]
        ),
        "/api/v1/jobs/{name}/start": _write("start", "Start the job", "run"),
        "/api/v1/jobs/{name}/stop": _write("stop", "Stop the job after its batch in flight", "run"),
        "/api/v1/jobs/{name}/savepoint": _write("savepoint", "Take a savepoint", "action"),
        "/api/v1/jobs/{name}/stop-with-savepoint": _write("stop-with-savepoint", "Stop with a savepoint", "action"),
        "/api/v1/jobs/{name}/restore": _write("restore", "Restore a verified savepoint (job stopped)", "action"),
        "/api/v1/jobs/{name}/rollback": _write("rollback", "Roll back to a retained batch (job stopped)", "action"),
        "/api/v1/jobs/{name}/rescale": _write("rescale", "Change cores and/or state partitions", "action"),
        "/api/v1/jobs/{name}/upgrade-preview": _write(
            "upgrade-preview",
            "Check another pipeline against the job's state, on a scratch copy (migrate: 1 also runs the target's "
            "state migration and its first batch on the migrated state)",
            "action",
        ),
        "/api/v1/jobs/{name}/upgrade-shadow": _write(
            "upgrade-shadow", "Run another pipeline beside the job from a savepoint and diff its results", "action"
        ),
        "/api/v1/jobs/{name}/upgrade": _write(
            "upgrade",
            "Move the job to another pipeline with its state (refused when incompatible, unless migrate: 1 builds the "
            "new state with the target's declared migration, or empty_state: 1 starts without one)",
            "action",
        ),
        "/api/v1/jobs/{name}/upgrade-rollback": _write(
            "upgrade-rollback", "Roll the job's latest upgrade back from the savepoint it took", "action"
        ),
        "/api/v1/jobs/{name}/blue-green": _write(
            "blue-green",
            "Change the running job without stopping its output (a new pipeline version, new parameter values, new "
            "state partitions): the new version runs beside it, compared batch by batch, and takes over at a "
            "committed batch (auto: 1 once caught up and within the rules)",
            "action",
        ),
        "/api/v1/jobs/{name}/blue-green/state": _read(
            "The job's latest blue/green upgrade: green's batch beside the job's, its gain on the job, and its "
            "per-batch diff",
            {
                "type": "object",
                "properties": {
                    "blue_batch": {"type": ["integer", "null"]},
                    "green_batch": {"type": ["integer", "null"]},
                    "behind": {"type": ["integer", "null"], "description": "the job's batches green has not run"},
                    "catch_up": {
                        "type": ["object", "null"],
                        "description": "green's gain on the job over the last minute (null before the first)",
                        "properties": {
                            "was": {"type": "integer"},
                            "behind": {"type": "integer"},
                            "gained": {"type": "integer", "description": "negative: green fell further behind"},
                            "seconds": {"type": "integer"},
                            "gaining": {"type": "boolean"},
                            "without_gain": {"type": "integer", "description": "minutes in a row without a gain"},
                            "to_go_seconds": {"type": ["integer", "null"], "description": "at this pace"},
                        },
                    },
                    "pace": {"type": "string", "description": "the same in words, as the page says it"},
                    "gap_seconds": {"type": ["number", "null"]},
                },
            },
            [NAME],
        ),
        "/api/v1/jobs/{name}/blue-green/promote": _green(
            "Hand over to the new version now (it waits for it to catch up)"
        ),
        "/api/v1/jobs/{name}/blue-green/abort": _green(
            "Stop the new version before the handover; the job is untouched"
        ),
        "/api/v1/jobs/{name}/dead-letters": _read(
            "The job's dead letters, newest first (next_before as before for older ones)",
            {
                "type": "object",
                "properties": {
                    "dead_letters": {"type": "array", "items": {"type": "object"}},
                    "total": {"type": "integer"},
                    "next_before": {"type": "string", "nullable": True},
                    "redrive": {"type": "string"},
                },
            },
            [NAME, LIMIT, {"name": "before", "in": "query", "schema": {"type": "string", "maxLength": 41}}],
        ),
        "/api/v1/jobs/{name}/redrive-dead-letters": _write(
            "redrive-dead-letters",
            "Re-drive dead letters into the job's source stream once their cause is fixed",
            "action",
        ),
    }
    _jobs_as_code(paths)
    _secrets(paths)
    _checkpoint_decision(paths)
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "Statekeeper API",
            "version": "1",
            "description": "Jobs, runs, checkpoints, savepoints and operator actions of Spark Structured Streaming "
            "jobs. Authenticate with `Authorization: Bearer <token>` (`manage.py create_token USER NAME`); the "
            "token acts with its user's role (viewer reads, operator acts, admin creates, changes and archives jobs).",
        },
        "paths": paths,
        "components": {
            "schemas": {
                "Checkpoint": CHECKPOINT,
                "Job": JOB,
                "Run": RUN,
                "Savepoint": SAVEPOINT,
                "Action": ACTION,
                "Secret": SECRET,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def schema_view(request: HttpRequest) -> JsonResponse:
    return JsonResponse(schema())
