"""Passwords written into a value, in every form a connection string takes: one definition for the SDK (a sink's
description) and the console (refusing, masking and moving them into secrets). Private: not part of the SDK's API.

- URL userinfo: ``postgres://user:PASSWORD@host/db``, ``jdbc:postgresql://user:PASSWORD@host/db``;
- key=value, unquoted: libpq's ``password=PASSWORD`` and ``sslpassword=…``, JDBC's ``?user=u&password=PASSWORD``
  and ``;password=PASSWORD;``, ODBC's ``pwd=…``, ``PGPASSWORD=…``;
- key=value, quoted: libpq's ``password='PASS WORD'`` (``\\'`` inside), and ``password="PASSWORD"`` as Kafka's SASL
  JAAS config writes it (``PlainLoginModule required username="u" password="PASSWORD";``).

Each pattern's groups are ``lead`` (kept), ``password`` and ``tail`` (kept): a quoted password keeps its quotes.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_KEY = r"(?<![A-Za-z0-9_])(?:ssl|pg)?(?:password|passwd|pwd)\s*=\s*"
LITERAL_PASSWORDS = (
    re.compile(r"(?P<lead>://[^/\s:@]*:)(?P<password>[^@\s]+)(?P<tail>@)"),
    re.compile(rf"(?P<lead>{_KEY}')(?P<password>(?:[^'\\]|\\.)*)(?P<tail>')", re.IGNORECASE),
    re.compile(rf'(?P<lead>{_KEY}")(?P<password>(?:[^"\\]|\\.)*)(?P<tail>")', re.IGNORECASE),
    re.compile(rf"(?P<lead>{_KEY})(?P<password>[^\s'\";&]+)(?P<tail>)", re.IGNORECASE),
)
MASK = "***"


def replace_passwords(text: str, replacement: Callable[[str], str | None]) -> str:
    """The text with each password written into it replaced by ``replacement(password)`` (None keeps it as it is)."""

    def swap(m: re.Match[str]) -> str:
        new = replacement(m["password"]) if m["password"] else None
        return m.group(0) if new is None else m["lead"] + new + m["tail"]

    for pattern in LITERAL_PASSWORDS:
        text = pattern.sub(swap, text)
    return text


def redacted(text: str) -> str:
    """The text with every password written into it shown as ***."""
    return replace_passwords(text, lambda password: MASK)
