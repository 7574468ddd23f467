from django.db import migrations, models


class Migration(migrations.Migration):
    """Actions become resumable steps: no worker slot waits on a driver, a start or a Spark process."""

    dependencies = [
        ("dashboard", "0022_run_executors"),
    ]

    operations = [
        migrations.AddField(model_name="action", name="step", field=models.CharField(blank=True, max_length=40)),
        migrations.AddField(model_name="action", name="phases", field=models.JSONField(blank=True, default=list)),
        migrations.AddField(
            model_name="action", name="wake_at", field=models.DateTimeField(blank=True, db_index=True, null=True)
        ),
        migrations.AddField(model_name="action", name="claimed_by", field=models.CharField(blank=True, max_length=120)),
        migrations.AddField(model_name="action", name="claimed_until", field=models.DateTimeField(blank=True, null=True)),
        migrations.AddField(
            model_name="action",
            name="resumed",
            field=models.PositiveIntegerField(default=0, help_text="steps run again after their worker died"),
        ),
        migrations.AddField(
            model_name="action",
            name="memo",
            field=models.JSONField(blank=True, default=dict, help_text="what a step keeps between its visits"),
        ),
        # the help text the model has said since 0022 (no change to the table)
        migrations.AlterField(
            model_name="run",
            name="executors",
            field=models.JSONField(blank=True, default=list, help_text="the hosts its executors run on, on a cluster"),
        ),
    ]
