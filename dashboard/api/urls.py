from django.urls import path, re_path

from dashboard.api import openapi, views

app_name = "api"
urlpatterns = [
    path("openapi.json", openapi.schema_view, name="openapi"),
    path("v1/jobs", views.jobs, name="jobs"),
    path("v1/plan", views.plan, name="plan"),
    path("v1/jobs/<str:name>", views.job, name="job"),
    path("v1/jobs/<str:name>/runs", views.runs, name="runs"),
    path("v1/jobs/<str:name>/checkpoints", views.checkpoints, name="checkpoints"),
    path("v1/jobs/<str:name>/savepoints", views.savepoints, name="savepoints"),
    path("v1/jobs/<str:name>/results", views.results, name="results"),
    path("v1/jobs/<str:name>/actions", views.actions, name="actions"),
    path("v1/jobs/<str:name>/dead-letters", views.dead_letters, name="dead_letters"),
    path("v1/actions/<int:action_id>", views.action, name="action"),
    path("v1/secrets", views.secrets, name="secrets"),
    path("v1/secrets/<str:name>", views.secret, name="secret"),
    path("v1/jobs/<str:name>/checkpoint-decision", views.checkpoint_decision, name="checkpoint_decision"),
    path("v1/jobs/<str:name>/start", views.start, name="start"),
    path("v1/jobs/<str:name>/stop", views.stop, name="stop"),
    path("v1/jobs/<str:name>/savepoint", views.savepoint, name="savepoint"),
    path("v1/jobs/<str:name>/stop-with-savepoint", views.stop_with_savepoint, name="stop_with_savepoint"),
    path("v1/jobs/<str:name>/restore", views.restore, name="restore"),
    path("v1/jobs/<str:name>/rollback", views.rollback, name="rollback"),
    path("v1/jobs/<str:name>/rescale", views.rescale, name="rescale"),
    path("v1/jobs/<str:name>/upgrade-preview", views.upgrade_preview, name="upgrade_preview"),
    path("v1/jobs/<str:name>/upgrade-shadow", views.upgrade_shadow, name="upgrade_shadow"),
    path("v1/jobs/<str:name>/upgrade", views.upgrade, name="upgrade"),
    path("v1/jobs/<str:name>/upgrade-rollback", views.upgrade_rollback, name="upgrade_rollback"),
    path("v1/jobs/<str:name>/blue-green", views.blue_green, name="blue_green"),
    path("v1/jobs/<str:name>/blue-green/state", views.blue_green_state, name="blue_green_state"),
    path("v1/jobs/<str:name>/blue-green/promote", views.blue_green_promote, name="blue_green_promote"),
    path("v1/jobs/<str:name>/blue-green/abort", views.blue_green_abort, name="blue_green_abort"),
    path("v1/jobs/<str:name>/redrive-dead-letters", views.redrive_dead_letters, name="redrive_dead_letters"),
    # anything else under /api/ is a JSON 404, never the console's HTML page
    re_path(r"^", views.not_found, name="not_found"),
]
