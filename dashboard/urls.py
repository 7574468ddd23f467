from django.urls import path

from dashboard import views

app_name = "dashboard"
urlpatterns = [
    path("", views.job_list, name="job_list"),
    path("live", views.jobs_live, name="jobs_live"),
    path("alerts/", views.alert_list, name="alert_list"),
    path("audit/", views.audit_list, name="audit_list"),
    path("secrets/", views.secret_list_view, name="secret_list"),
    path("capacity/", views.capacity, name="capacity"),
    path("jobs/new", views.job_create, name="job_create"),
    path("jobs/<str:name>/", views.job_detail, name="job_detail"),
    path("jobs/<str:name>/exceptions", views.job_exceptions, name="job_exceptions"),
    path("jobs/<str:name>/skip-entries", views.job_skip_entries, name="job_skip_entries"),
    path("jobs/<str:name>/checkpoints", views.job_checkpoints, name="job_checkpoints"),
    path("jobs/<str:name>/state", views.job_state, name="job_state"),
    path("jobs/<str:name>/savepoints", views.job_savepoints, name="job_savepoints"),
    path("jobs/<str:name>/runs", views.job_runs, name="job_runs"),
    path("jobs/<str:name>/deploys", views.job_deploys, name="job_deploys"),
    path("jobs/<str:name>/upgrade", views.job_upgrade, name="job_upgrade"),
    path("jobs/<str:name>/upgrade/rollback", views.job_upgrade_rollback, name="job_upgrade_rollback"),
    path("jobs/<str:name>/blue-green", views.job_blue_green, name="job_blue_green"),
    path("jobs/<str:name>/blue-green/<str:what>", views.job_blue_green_request, name="job_blue_green_request"),
    path("jobs/<str:name>/alerts", views.job_alerts, name="job_alerts"),
    path("jobs/<str:name>/results", views.job_results, name="job_results"),
    path("jobs/<str:name>/dead-letters", views.job_dead_letters, name="job_dead_letters"),
    path("jobs/<str:name>/edit", views.job_edit, name="job_edit"),
    path("jobs/<str:name>/start", views.job_start, name="job_start"),
    path(
        "jobs/<str:name>/checkpoint/<str:decision>",
        views.job_checkpoint_decide,
        name="job_checkpoint_decide",
    ),
    path("jobs/<str:name>/stop", views.job_stop, name="job_stop"),
    path("jobs/<str:name>/savepoint", views.job_savepoint, name="job_savepoint"),
    path("jobs/<str:name>/stop-with-savepoint", views.job_stop_with_savepoint, name="job_stop_with_savepoint"),
    path("jobs/<str:name>/savepoints/<int:savepoint_id>/restore", views.job_restore, name="job_restore"),
    path("jobs/<str:name>/savepoints/<int:savepoint_id>/dispose", views.savepoint_dispose, name="savepoint_dispose"),
    path("jobs/<str:name>/rollback", views.job_rollback, name="job_rollback"),
    path("jobs/<str:name>/rescale", views.job_rescale, name="job_rescale"),
    path("jobs/<str:name>/storage", views.job_storage, name="job_storage"),
    path("jobs/<str:name>/inspect", views.job_inspect, name="job_inspect"),
    path("jobs/<str:name>/count-partition-rows", views.job_count_rows, name="job_count_rows"),
    path("jobs/<str:name>/series.json", views.job_series, name="job_series"),
    path("jobs/<str:name>/live", views.job_live, name="job_live"),
    path(
        "jobs/<str:name>/old-checkpoints/<str:directory>/discard", views.checkpoint_discard, name="checkpoint_discard"
    ),
]
