import os

from celery import Celery
from celery.signals import celeryd_after_setup

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_PROCESS", "worker")  # named in pg_stat_activity (an entry point may say otherwise)

app = Celery("statekeeper")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"])


@celeryd_after_setup.connect
def _consume_this_hosts_queue(sender: str, instance: object, **kwargs: object) -> None:
    from django.conf import settings

    from dashboard.services.enqueue import host_queue

    instance.app.amqp.queues.select_add(host_queue(settings.HOST_ID))  # type: ignore[attr-defined]
