import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")

app = Celery("statekeeper")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"])
