"""Passwords written into job parameters before secrets existed leave every place that showed them.

- What a job runs with (its parameters, its applied spec, its deploys, its upgrades' parameters): each password moves
  into a secret, encrypted, named after the job and the parameter, and the value keeps ``${secret:NAME}`` in its
  place, so the job still writes where it did and an upgrade's rollback still finds its values.
- History (the audit trail, idempotent API replies, runs' messages, alerts): the password becomes ***, the user and
  host kept.
- The audit trail records that the masking happened, with counts, never a value.

Running it twice changes nothing the second time: a reference is not a password. It is self-contained (it does not
import the app's code, which may change after it lands), but it encrypts as dashboard/services/secrets.py does.
"""

import base64
import hashlib
import re

from django.conf import settings
from django.db import migrations

REFERENCE = re.compile(r"\$\{secret:[^}]*\}")
LITERAL_PASSWORDS = (
    re.compile(r"(?P<lead>://[^/\s:@]*:)(?P<password>[^@\s]+)(?P<tail>@)"),
    re.compile(r"(?P<lead>\bpassword\s*=\s*)(?P<password>[^\s'\"]+)(?P<tail>)", re.IGNORECASE),
)


def _fernet():
    from cryptography.fernet import Fernet, MultiFernet

    keys = list(settings.SECRETS_KEYS)
    if not keys:
        derived = hashlib.sha256(b"statekeeper-secrets:" + settings.SECRET_KEY.encode()).digest()
        keys = [base64.urlsafe_b64encode(derived).decode()]
    return MultiFernet([Fernet(k) for k in keys])


def _replace(text, replacement, patterns):
    """The text with each literal password replaced by ``replacement(password)``; and how many there were. A quoted
    password (a later migration's patterns) keeps its quotes around the replacement, and its escapes in it."""
    count = 0

    def swap(m):
        nonlocal count
        password = m.group("password")
        if not password or REFERENCE.fullmatch(password) or password == "***":  # a reference, or masked
            return m.group(0)
        count += 1
        return m["lead"] + replacement(password) + m["tail"]

    for pattern in patterns:
        text = pattern.sub(swap, text)
    return text, count


def _walk(value, on_text, key=""):
    """The JSON value with ``on_text(key, text)`` applied to every text in it; and how many passwords it replaced."""
    if isinstance(value, str):
        return on_text(key, value)
    total = 0
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out[k], n = _walk(v, on_text, str(k))
            total += n
        return out, total
    if isinstance(value, list):
        out_list = []
        for v in value:
            item, n = _walk(v, on_text, key)
            out_list.append(item)
            total += n
        return out_list, total
    return value, 0


def forward(apps, schema_editor, patterns=LITERAL_PASSWORDS):
    """Move or mask every password ``patterns`` find (a later migration passes more forms)."""
    Job = apps.get_model("dashboard", "Job")
    Deploy = apps.get_model("dashboard", "Deploy")
    Action = apps.get_model("dashboard", "Action")
    Run = apps.get_model("dashboard", "Run")
    Alert = apps.get_model("dashboard", "Alert")
    AuditEntry = apps.get_model("dashboard", "AuditEntry")
    IdempotentRequest = apps.get_model("dashboard", "IdempotentRequest")
    Secret = apps.get_model("dashboard", "Secret")
    fernet = None
    made = {}  # (job, parameter, password) -> secret name

    def secret_for(job, parameter, password):
        nonlocal fernet
        if (job.id, parameter, password) in made:
            return made[job.id, parameter, password]
        fernet = fernet or _fernet()
        base = re.sub(r"[^a-z0-9_.-]+", "-", f"{job.name}-{parameter}".lower()).strip("-.")[:50] or "secret"
        name, n = base, 1
        while Secret.objects.filter(name=name).exists():
            n += 1
            name = f"{base}-{n}"
        Secret.objects.create(
            name=name, ciphertext=fernet.encrypt(password.encode()).decode(), created_by="migration"
        )
        made[job.id, parameter, password] = name
        return name

    def into_secrets(job):
        return lambda key, text: _replace(
            text, lambda pw: "${secret:" + secret_for(job, key or "value", pw) + "}", patterns
        )

    def masking(key, text):
        return _replace(text, lambda pw: "***", patterns)

    counts = {"job parameters": 0, "deploys": 0, "upgrades": 0, "audit entries": 0, "replies": 0, "runs": 0,
              "alerts": 0}
    for job in Job.objects.all():
        parameters, n = _walk(job.parameters or {}, into_secrets(job))
        spec, m = _walk(job.applied_spec or {}, into_secrets(job))
        if n or m:
            Job.objects.filter(id=job.id).update(parameters=parameters, applied_spec=spec)
            counts["job parameters"] += n + m
        for deploy in Deploy.objects.filter(job_id=job.id):
            parameters, n = _walk(deploy.parameters or {}, into_secrets(job))
            if n:
                Deploy.objects.filter(id=deploy.id).update(parameters=parameters)
                counts["deploys"] += n
        for action in Action.objects.filter(job_id=job.id):
            params, n = _walk(action.params or {}, into_secrets(job))
            memo, m = _walk(action.memo or {}, into_secrets(job))
            outcome, o = masking("", action.outcome or "")
            if n or m or o:
                Action.objects.filter(id=action.id).update(params=params, memo=memo, outcome=outcome)
                counts["upgrades"] += n + m + o
    for run in Run.objects.exclude(message="", error=""):
        message, n = masking("", run.message or "")
        error, m = masking("", run.error or "")
        if n or m:
            Run.objects.filter(id=run.id).update(message=message, error=error)
            counts["runs"] += n + m
    for alert in Alert.objects.all():
        message, n = masking("", alert.message or "")
        latest, m = masking("", alert.latest or "")
        if n or m:
            Alert.objects.filter(id=alert.id).update(message=message, latest=latest)
            counts["alerts"] += n + m
    for reply in IdempotentRequest.objects.all():
        response, n = _walk(reply.response or {}, masking)
        if n:
            IdempotentRequest.objects.filter(id=reply.id).update(response=response)
            counts["replies"] += n
    audit = []
    for entry in AuditEntry.objects.all():
        params, n = _walk(entry.params or {}, masking)
        message, m = masking("", entry.message or "")
        target, t = masking("", entry.target or "")
        if n or m or t:
            audit.append((entry.id, params, message, target))
            counts["audit entries"] += n + m + t
    if audit:
        # the trail is append-only (a trigger refuses updates on PostgreSQL); this one masking is its only exception
        postgres = schema_editor.connection.vendor == "postgresql"
        with schema_editor.connection.cursor() as cursor:
            if postgres:
                cursor.execute("ALTER TABLE dashboard_auditentry DISABLE TRIGGER audit_append_only")
            try:
                for entry_id, params, message, target in audit:
                    AuditEntry.objects.filter(id=entry_id).update(params=params, message=message, target=target)
            finally:
                if postgres:
                    cursor.execute("ALTER TABLE dashboard_auditentry ENABLE TRIGGER audit_append_only")
    if any(counts.values()):
        AuditEntry.objects.create(
            origin="system",
            verb="secrets-masked",
            outcome="succeeded",
            params={k: v for k, v in counts.items() if v} | {"secrets_created": sorted(set(made.values()))},
            message="Passwords written into job parameters were moved into secrets (where jobs run with them) and "
            "masked as *** in history; no value is kept here.",
        )


class Migration(migrations.Migration):
    dependencies = [("dashboard", "0029_secrets")]

    operations = [migrations.RunPython(forward, migrations.RunPython.noop)]
