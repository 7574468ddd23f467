"""Secrets for the jobs' sinks: passwords and keys the console keeps encrypted and never shows again.

A job's parameters never hold a password. They name a secret instead, anywhere in a text value:

    orders_dsn = postgres://team:${secret:team-db-password}@db.internal/team_orders

The job's settings, its spec, its deploys, the audit trail, the pages, the API and the CLI only ever hold that
reference. Only an admin sets or rotates a secret (``secret_set``); its value is encrypted at rest with
STATEKEEPER_SECRETS_KEY (Fernet, from the maintained ``cryptography`` package). A job's driver reveals the references
as the job starts (``reveal``), for its sinks alone: the pipeline's transform sees the reference, and a rotation takes
effect at the job's next start or upgrade. Whatever the driver writes back (a run's message, its log) passes through
``redact``, which masks every value it revealed.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import threading
from collections.abc import Collection, Mapping
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone
from statekeeper_sdk._passwords import LITERAL_PASSWORDS, MASK, replace_passwords

from dashboard import pipelines
from dashboard.kafka import Cluster, KafkaUnavailable
from dashboard.models import SECRET_NAME, SECRET_NAME_PATTERN, Secret
from dashboard.selectors.secrets import REFERENCE, referenced, used_by

VALID_NAME = re.compile(SECRET_NAME_PATTERN)
MAX_VALUE = 10_000


class SecretError(ValueError):
    """A secret that cannot be set, deleted or revealed; the message says why and what to do."""


def _fernet() -> MultiFernet:
    keys = list(settings.SECRETS_KEYS)
    if not keys:
        if not settings.DEVELOPMENT:  # settings refuse to start so; this guards a test that unsets it
            raise ImproperlyConfigured("STATEKEEPER_SECRETS_KEY is unset")
        derived = hashlib.sha256(b"statekeeper-secrets:" + settings.SECRET_KEY.encode()).digest()
        keys = [base64.urlsafe_b64encode(derived).decode()]
    return MultiFernet([Fernet(k) for k in keys])


def encrypt(value: str) -> str:
    return _fernet().encrypt(value.encode()).decode()


def decrypt(secret: Secret) -> str:
    try:
        return _fernet().decrypt(secret.ciphertext.encode()).decode()
    except InvalidToken:
        raise SecretError(
            f"the secret {secret.name!r} cannot be decrypted with STATEKEEPER_SECRETS_KEY (the key it was set with "
            "is gone): an admin sets it again"
        ) from None


def readable(secret: Secret) -> bool:
    """Whether the current keys (STATEKEEPER_SECRETS_KEY) decrypt the secret: one set under a key that is gone cannot
    be read by a driver, and is set again by an admin."""
    try:
        _fernet().decrypt(secret.ciphertext.encode())
    except InvalidToken:
        return False
    return True


def secrets_reencrypt() -> tuple[int, list[str]]:
    """Re-encrypt every secret with the first of the current keys (after a new key was put first in
    STATEKEEPER_SECRETS_KEY, before the old one leaves it): how many were, and the names no current key reads."""
    fernet, done, unreadable = _fernet(), 0, []
    for secret in Secret.objects.order_by("name"):
        try:
            rotated = fernet.rotate(secret.ciphertext.encode()).decode()
        except InvalidToken:
            unreadable.append(secret.name)
            continue
        Secret.objects.filter(id=secret.id, ciphertext=secret.ciphertext).update(ciphertext=rotated)
        done += 1
    return done, unreadable


def name_problem(name: str) -> str:
    if not VALID_NAME.match(name):
        return f"{name[:80]!r} is not a secret's name: {SECRET_NAME.message}"
    return ""


def secret_set(*, name: str, value: str, username: str) -> tuple[Secret, bool]:
    """Create the secret, or rotate it (its version grows by one); returns it and whether it was created. The value
    is refused when empty or over MAX_VALUE characters."""
    if problem := name_problem(name):
        raise SecretError(problem)
    if not isinstance(value, str) or not value:
        raise SecretError("a secret's value is a non-empty text")
    if len(value) > MAX_VALUE or "\x00" in value:
        raise SecretError(f"a secret's value is at most {MAX_VALUE:,} characters, with no NUL")
    ciphertext = encrypt(value)
    with transaction.atomic():
        updated = Secret.objects.filter(name=name).update(
            ciphertext=ciphertext, version=F("version") + 1, rotated_at=timezone.now(), rotated_by=username
        )
        if updated:
            return Secret.objects.get(name=name), False
        try:
            with transaction.atomic():
                return Secret.objects.create(name=name, ciphertext=ciphertext, created_by=username), True
        except IntegrityError:  # created by another request in between: this one rotates it
            return secret_set(name=name, value=value, username=username)


def secret_delete(*, name: str) -> None:
    """Delete a secret no job names; refused with the jobs that still do."""
    if users := used_by(name):
        raise SecretError(f"{', '.join(j.name for j in users)} still name the secret {name!r}: change them first")
    if not Secret.objects.filter(name=name).delete()[0]:
        raise SecretError(f"there is no secret named {name!r}")


def versions(values: Any) -> dict[str, int]:
    """The version of each secret the values name, as a deploy records it (a rotation makes a new deploy)."""
    names = referenced(values)
    return dict(Secret.objects.filter(name__in=names).values_list("name", "version")) if names else {}


def _literal(password: str) -> bool:
    """Whether a password written into a value is one: not a reference to a secret, nor masked already."""
    return bool(password) and password != MASK and not REFERENCE.fullmatch(password)


def has_literal_password(text: str) -> bool:
    return any(_literal(m.group("password")) for pattern in LITERAL_PASSWORDS for m in pattern.finditer(text))


def mask_passwords(text: str) -> str:
    """The text with every password written into it (statekeeper_sdk._passwords lists the forms) replaced by ***, the
    user and host kept; a reference to a secret is kept as it is."""
    return replace_passwords(text, lambda password: MASK if _literal(password) else None)


def into_secret(text: str, *, name: str, username: str) -> str:
    """The text with the password written into it moved into the secret ``name`` (set, or rotated) and a reference in
    its place; the text as it is when it holds none."""
    for pattern in LITERAL_PASSWORDS:
        if (found := pattern.search(text)) and _literal(found.group("password")):
            # a quoted password is kept as written between its quotes (escapes and all): the reference stays between
            # them, so the text the job runs with is the text it was given
            secret_set(name=name, value=found["password"], username=username)
            reference = "${secret:" + name + "}"
            return text[: found.start("password")] + reference + text[found.end("password") :]
    return text


def masked(value: Any, pipeline: str = "") -> Any:
    """A JSON value as history may keep it (the audit trail, a refused request): every password written into a text
    masked, and, for ``pipeline``'s parameters declared secret, any value that is not a reference."""
    secret = {p.name for p in getattr(pipelines.find(pipeline), "parameters", ()) or () if getattr(p, "secret", False)}

    def walk(item: Any, key: str = "") -> Any:
        if isinstance(item, str):
            return MASK if key in secret and item and not REFERENCE.fullmatch(item) else mask_passwords(item)
        if isinstance(item, Mapping):
            return {k: walk(v, str(k)) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [walk(v, key) for v in item]
        return item

    return walk(value)


def value_problems(pipeline: str, values: Mapping[str, Any], secret_only: Collection[str] = ()) -> list[str]:
    """Why these parameter values cannot be a job's, as far as secrets go, one line each: a password written in
    (it belongs in a secret), a reference to no secret, a secret parameter (the pipeline's, or one of ``secret_only``:
    a Kafka source's ``sasl_password``) given a plain value."""
    declared = {p.name: p for p in getattr(pipelines.find(pipeline), "parameters", ()) or ()}
    secrets = {name for name, p in declared.items() if getattr(p, "secret", False)} | set(secret_only)
    known = set(Secret.objects.filter(name__in=referenced(values)).values_list("name", flat=True))
    problems = []
    for name, value in values.items():
        if not isinstance(value, str):
            continue
        if has_literal_password(value):
            problems.append(
                f"{name}: holds a password; keep it in a secret (Secrets, admin) and write ${{secret:NAME}} in its "
                "place, e.g. postgres://team:${secret:team-db-password}@host/db"
            )
        for ref in REFERENCE.findall(value):
            if problem := name_problem(ref):
                problems.append(f"{name}: {problem}")
            elif ref not in known:
                problems.append(f"{name}: there is no secret named {ref!r} (an admin creates it on the Secrets page)")
        if name in secrets and value and not REFERENCE.fullmatch(value):
            problems.append(
                f"{name}: is a secret: give it as ${{secret:NAME}}, a secret the console keeps, never the password itself"
            )
    return problems


# Every value this process revealed, so that what it writes back can be masked (a driver process runs jobs only).
_revealed: set[str] = set()
_revealed_lock = threading.Lock()


def reveal(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values with each ``${secret:NAME}`` replaced by the secret's value, for a job's sinks; SecretError names a
    secret that is missing or cannot be decrypted. Every value revealed is then masked by ``redact``."""
    names = referenced(values)
    if not names:
        return dict(values)
    found = {s.name: s for s in Secret.objects.filter(name__in=names)}
    if missing := [n for n in names if n not in found]:
        raise SecretError(f"there is no secret named {missing[0]!r} (an admin sets it on the Secrets page)")
    plain = {n: decrypt(found[n]) for n in names}
    with _revealed_lock:
        _revealed.update(v for v in plain.values() if len(v) >= 3)
    return {
        name: REFERENCE.sub(lambda m: plain[m.group(1)], value) if isinstance(value, str) else value
        for name, value in values.items()
    }


def security_revealed(security: Mapping[str, Any]) -> dict[str, str]:
    """A Kafka source's security settings with its password's secret revealed, as both Kafka clients take them (the
    console's, ``kafka_cluster``; Spark's, in the process that starts the query). SecretError as ``reveal``."""
    return {str(k): str(v) for k, v in reveal(security).items()}


def kafka_cluster(job: Any) -> Cluster:
    """Where a Kafka job's topic lives, for the console's own client (lag, previews, restores): its servers and its
    security settings, the password revealed in this process (and so masked by ``redact``). A secret that is missing
    or unreadable is the broker's answer that nothing can be read (``KafkaUnavailable``), named."""
    try:
        return Cluster(job.source_path, security_revealed(job.source_security or {}))
    except SecretError as exc:
        raise KafkaUnavailable(f"the Kafka password cannot be had: {exc}") from None


def redact(text: str) -> str:
    """The text without any value this process revealed, nor any password written into a connection string."""
    if not text:
        return text
    with _revealed_lock:
        known = sorted(_revealed, key=len, reverse=True)
    for value in known:
        text = text.replace(value, MASK)
    return mask_passwords(text)


class RedactingFilter(logging.Filter):
    """Masks revealed secrets in every record a handler writes (a driver's log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


def redact_logs() -> None:
    """Install the filter on every handler of the root logger (a driver process calls this once it has set up its
    logging)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
