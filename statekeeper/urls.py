from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from dashboard.forms import ThrottledLoginForm
from dashboard.metrics import metrics

urlpatterns = [
    path("admin/", admin.site.urls),
    path("login/", auth_views.LoginView.as_view(authentication_form=ThrottledLoginForm), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("metrics", metrics, name="metrics"),
    path("api/", include("dashboard.api.urls")),
    path("", include("dashboard.urls")),
]
