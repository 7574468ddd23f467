"""The JSON API for automation: token authentication, the same roles as the console, idempotent actions."""
