import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
# Under ASGI Django runs each request's database work in a thread of its own, and a persistent connection stays with
# its thread, idle, past CONN_MAX_AGE (Django advises against them there): the web process closes each request's
# connection when the request ends, and so holds one per request in flight at most.
os.environ.setdefault("STATEKEEPER_DB_CONN_MAX_AGE", "0")
os.environ["STATEKEEPER_PROCESS"] = "web"  # named in pg_stat_activity (settings: application_name)
application = get_asgi_application()
