from django.urls import path

from dashboard import views

app_name = "dashboard"
urlpatterns = [
    path("", views.job_list, name="job_list"),
    path("jobs/new", views.job_create, name="job_create"),
    path("jobs/<str:name>/", views.job_detail, name="job_detail"),
    path("jobs/<str:name>/edit", views.job_edit, name="job_edit"),
    path("jobs/<str:name>/start", views.job_start, name="job_start"),
    path("jobs/<str:name>/stop", views.job_stop, name="job_stop"),
]
