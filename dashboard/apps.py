from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "dashboard"
    verbose_name = "Statekeeper"

    def ready(self) -> None:
        from dashboard import signals  # noqa: F401  # registers the audit trail's login receivers
