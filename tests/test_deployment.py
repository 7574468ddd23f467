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
