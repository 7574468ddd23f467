from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from dashboard.forms import ThrottledLoginForm

urlpatterns = [
    path("admin/", admin.site.urls),
    path("login/", auth_views.LoginView.as_view(authentication_form=ThrottledLoginForm), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include("dashboard.urls")),
]
