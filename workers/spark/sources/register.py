"""Registering a Python data source in a session that is not the thread's active one.

Spark refuses a registration with DATA_SOURCE_ALREADY_EXISTS when the session registered into does not hold the name
but the thread's active session does: it looks the name up in the active session's sources. The state reader plans
and previews in sessions of their own (``newSession``), on threads that served other sessions before, and a
migration's preview failed so. The session registered into is made the active one first."""

from __future__ import annotations

from typing import Any


def register(spark: Any, source: type) -> None:
    """``spark.dataSource.register(source)``, with ``spark`` the active session of this thread."""
    spark._jvm.SparkSession.setActiveSession(spark._jsparkSession)
    spark.dataSource.register(source)
