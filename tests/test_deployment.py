"""The deployment files parse and name what they need."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_docker_compose_runs_the_whole_stack_with_real_images():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "web", "worker", "beat", "spark-master", "spark-worker"} <= set(services)
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["redis"]["image"].startswith("redis:")
    for name in ("web", "worker", "beat", "spark-master", "spark-worker"):
        assert services[name]["image"] == "statekeeper:latest", name
    assert "celery" in services["worker"]["command"] and "beat" in services["beat"]["command"]
    assert services["worker"]["environment"]["STATEKEEPER_SPARK_MASTER"] == "spark://spark-master:7077"
    assert "org.apache.spark.deploy.master.Master" in services["spark-master"]["command"]
    # migrations run as the owner; the console's processes as the app role, which cannot rewrite the audit trail
    assert "migrate" in " ".join(services["migrate"]["command"])
    assert services["migrate"]["environment"]["DATABASE_URL"].startswith("postgres://statekeeper:")
    for name in ("web", "worker", "beat"):
        assert services[name]["environment"]["DATABASE_URL"].startswith("postgres://statekeeper_app:"), name


def test_the_image_installs_the_pinned_packages_and_java():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "requirements/lock.txt" in dockerfile
    assert "openjdk-17" in dockerfile


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```")[1]
    commands = [line.strip() for line in first_block.splitlines() if line.strip() and not line.startswith("bash")]
    assert commands == ["./bin/dev", "./bin/test"]
    assert "./bin/test" in (ROOT / ".ci" / "run").read_text()


def test_the_compose_cluster_is_the_one_the_tests_start_and_sees_the_checkpoint_root():
    from workers.spark.cluster import MASTER, WORKER

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert MASTER in services["spark-master"]["command"] and WORKER in services["spark-worker"]["command"]
    master = services["worker"]["environment"]["STATEKEEPER_SPARK_MASTER"]
    assert services["spark-worker"]["command"][-1] == master, "the worker registers with the master the drivers use"
    root = services["worker"]["environment"]["STATEKEEPER_CHECKPOINT_ROOT"]

    def volume_holding(name: str) -> str:
        mounts = [v.split(":") for v in services[name].get("volumes", [])]
        return next(volume for volume, target in mounts if root.startswith(target.rstrip("/") + "/"))

    # executors write the state files, drivers the offsets, the console reads both: one volume, at one path
    assert {volume_holding(name) for name in ("web", "worker", "beat", "spark-worker")} == {"checkpoints"}
    assert services["spark-worker"]["environment"]["SPARK_WORKER_CORES"]
    # the shared driver's one executor must fit on a worker, or it would wait for cores forever
    shared = int(services["worker"]["environment"]["STATEKEEPER_SHARED_DRIVER_CORES"])
    assert shared <= int(services["spark-worker"]["environment"]["SPARK_WORKER_CORES"])
