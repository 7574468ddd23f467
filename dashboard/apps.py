from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "dashboard"
    verbose_name = "Statekeeper"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from dashboard import signals  # noqa: F401  # registers the audit trail's login receivers
        from dashboard.services.db_role import grant_after_migrate

        post_migrate.connect(grant_after_migrate, sender=self, dispatch_uid="statekeeper-app-role")
