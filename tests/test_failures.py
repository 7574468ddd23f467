"""The cause, not the wrapper: the innermost error class and message come first."""

from __future__ import annotations

import pytest

from dashboard.failures import root_cause, signature

PY4J = """An exception was raised by the Python Proxy. Return Message: Traceback (most recent call last):
  File "/usr/lib/python3/dist-packages/py4j/clientserver.py", line 617, in _call_proxy
    return_value = getattr(self.pool[obj_id], method)(*params)
  File "/work/main/workers/sink.py", line 80, in write
    write_results(
  File "/work/main/workers/sink.py", line 55, in write_results
    cursor.executemany(
UnicodeEncodeError: 'utf-8' codec can't encode character '\\ud800' in position 0: surrogates not allowed
"""

JVM = """org.apache.spark.sql.streaming.StreamingQueryException: [STREAM_FAILED] Query [id = 1] terminated with exception
	at org.apache.spark.sql.execution.streaming.StreamExecution.runStream(StreamExecution.scala:338)
Caused by: org.apache.spark.SparkException: Job aborted due to stage failure
	at org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:2898)
Caused by: org.apache.spark.SparkException: [CANNOT_LOAD_STATE_STORE.UNCATEGORIZED] An error occurred during loading state.
Caused by: java.io.FileNotFoundException: File /tmp/x/state/0/1/3.delta does not exist
"""


def test_a_python_error_behind_py4j_is_named_first():
    assert root_cause(PY4J) == (
        "UnicodeEncodeError: 'utf-8' codec can't encode character '\\ud800' in position 0: surrogates not allowed"
    )


def test_the_innermost_jvm_cause_is_named_and_wrappers_are_skipped():
    assert root_cause(JVM) == "FileNotFoundException: File /tmp/x/state/0/1/3.delta does not exist"


def test_a_plain_message_is_its_own_cause():
    assert root_cause("The driver process exited without reporting (killed or crashed).").startswith("The driver")


def test_the_same_failure_on_another_entry_is_a_repeat():
    assert signature("ValueError: bad order 'o17' at 1795") == signature("ValueError: bad order 'o99' at 1800")


@pytest.mark.django_db
def test_a_run_whose_trace_holds_a_nul_ends_failed_with_its_message_kept(make_job):
    """A JVM trace may quote a plan's literal or a record with a NUL, which PostgreSQL's text refuses: the run still
    ends, with the NUL written as \\0, rather than staying "running" behind a DataError."""
    from dashboard.models import Run, RunStatus
    from dashboard.services.runs import run_finish

    run = Run.objects.create(job=make_job(), status=RunStatus.RUNNING)
    run_finish(run_id=run.id, status=RunStatus.FAILED, message="Literal a\x00b in the plan", error="at\x00trace")
    run.refresh_from_db()
    assert (run.status, run.message, run.error) == (RunStatus.FAILED, "Literal a\\0b in the plan", "at\\0trace")
