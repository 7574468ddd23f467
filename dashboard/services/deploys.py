"""Deploys: what each run ran. A driver records its deploy as it starts; checkpoints link to it through their run and
savepoints directly, so every piece of state says which code wrote it."""

from __future__ import annotations

import pyspark

from dashboard import pipelines
from dashboard.models import Checkpoint, Deploy, Job, Run
from dashboard.services.secrets import versions


def deploy_record(*, run: Run, spark_conf: dict[str, str], code: pipelines.CodeVersion) -> Deploy:
    """The deploy this run is about to run (the job's last one when nothing changed), linked to the run. ``code``: the
    pipeline's code as the driver loaded it."""
    job = run.job
    wanted = {
        "pipeline": job.pipeline,
        "reference": code.reference,
        "package": code.package,
        "code_hash": code.code_hash,
        "parameters": pipelines.parameter_values(job.pipeline, job.parameters),
        "secret_versions": versions(job.parameters),
        "spark_conf": dict(sorted(spark_conf.items())),
        "spark_version": pyspark.__version__,
    }
    last = job.deploys.order_by("-id").first()
    same = last is not None and all(getattr(last, field) == value for field, value in wanted.items())
    deploy = last if same and last is not None else Deploy.objects.create(job=job, operator=run.requested_by, **wanted)
    Run.objects.filter(id=run.id).update(deploy=deploy)
    run.deploy = deploy
    return deploy


def deploy_of_batch(job: Job, batch_id: int) -> Deploy | None:
    """The deploy whose run committed this batch of the job's current checkpoint directory."""
    record = (
        Checkpoint.objects.filter(job=job, location=job.checkpoint_dir, batch_id=batch_id)
        .select_related("run__deploy")
        .order_by("-id")
        .first()
    )
    if record is not None and record.run is not None and record.run.deploy is not None:
        return record.run.deploy
    return job.deploys.order_by("-id").first()
