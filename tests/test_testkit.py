"""The SDK's test kit as a team's CI uses it: a venv with PySpark, the SDK and the team's package only (no console),
running the package's own tests (examples/team_orders/tests, written with statekeeper_sdk.testing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_example_teams_tests_run_in_a_venv_without_the_console(tmp_path):
    # nothing of this run's own Python reaches the team's: Spark's Python workers would otherwise run the console's
    # interpreter, named by PYSPARK_PYTHON once the suite's SparkSession has started, and find its packages there
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH",
                                                           "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE")}  # fmt: skip
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "--no-compile", str(ROOT / "sdk"),
         str(ROOT / "examples" / "team_orders"), "pytest"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-2000:]
    have = subprocess.run([str(venv / "bin" / "pip"), "list", "--format=freeze"], capture_output=True, text=True,
                          cwd=tmp_path).stdout.lower()  # fmt: skip
    assert "pyspark==" in have and "statekeeper-sdk==" in have and "django" not in have and "celery" not in have
    ran = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "/dev/null",
         "--rootdir", str(tmp_path), str(ROOT / "examples" / "team_orders" / "tests")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert ran.returncode == 0 and "7 passed" in ran.stdout, ran.stdout[-3000:] + ran.stderr[-2000:]
