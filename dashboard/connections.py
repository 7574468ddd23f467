"""The console's Redis connection (a client per URL and timeout, reused: each holds a connection pool)."""

from __future__ import annotations

import redis
from django.conf import settings

_clients: dict[tuple[str, float], redis.Redis] = {}


def redis_client(timeout: float = 3) -> redis.Redis:
    key = (settings.REDIS_URL, timeout)
    if key not in _clients:
        _clients[key] = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=timeout, socket_connect_timeout=timeout)
    return _clients[key]
