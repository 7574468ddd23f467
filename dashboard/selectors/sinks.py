"""Where a job's output goes and where each sink stands, read from the sink itself (its commit table, its file log, the
results table) against the job's checkpoint: the Results tab, the restore and rollback previews, a savepoint's
manifest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.db.models import Max
from statekeeper_sdk import FileSink, ResultsTable, TableSink

from dashboard import pipelines
from dashboard.checkpoint_dir.files import CheckpointError, latest_committed, lineage_base
from dashboard.engine.sinks import FileLog, Position, TableWriter
from dashboard.models import Job, ResultRow

KINDS = {"results": "Results table", "table": "Team table", "files": "Files", "kafka": "Kafka topic"}


@dataclass(frozen=True)
class SinkState:
    name: str
    kind: str
    where: str
    off: bool
    position: Position
    checkpoint_batch: int | None

    @property
    def kind_title(self) -> str:
        return KINDS.get(self.kind, self.kind)

    @property
    def behind(self) -> int | None:
        """Batches the sink lacks against the checkpoint (negative: it holds a batch the checkpoint has not committed,
        which the next run replays and the sink skips). None for the results table, whose rows keep only the batch that
        last changed them."""
        if self.kind == "results" or self.position.last_batch is None or self.checkpoint_batch is None:
            return None
        return self.checkpoint_batch - self.position.last_batch


def sink_position(job: Job, sink: Any) -> Position:
    if isinstance(sink, ResultsTable):
        # each row keeps only the batch that last changed it: the newest batch's rows are that batch's whole output
        batches = ResultRow.objects.filter(job=job)
        last = batches.aggregate(last=Max("batch_id"))["last"]
        return Position(last, ((last, batches.filter(batch_id=last).count()),) if last is not None else ())
    if isinstance(sink, TableSink):
        writer = TableWriter(sink, job.name, 0)
        try:
            return writer.position()
        finally:
            writer.close()
    if isinstance(sink, FileSink):
        try:
            return FileLog(sink.path).position()
        except (OSError, ValueError) as exc:
            return Position(None, (), str(exc)[:300])
    return Position(None, (), "Kafka keeps no commit of its own: every record carries its batch in a header")


def job_sinks(job: Job) -> list[SinkState]:
    """Each sink of the job's pipeline with the job's parameter values, where it stands, and the checkpoint's batch in
    the sinks' numbers."""
    if pipelines.find(job.pipeline) is None:
        return []
    values = pipelines.values_or_stored(job.pipeline, job.parameters or {})
    try:
        sinks = pipelines.bound_sinks(job.pipeline, values)
    except ValueError:
        return []
    try:  # in the sinks' numbers (a migrated line's batch 0 is its base)
        checkpoint: int | None = lineage_base(job.checkpoint_location) + latest_committed(job.checkpoint_location)
    except Exception:
        checkpoint = None
    found = []
    for sink in sinks:
        off = sink.off()
        position = Position(None) if off else sink_position(job, sink)
        found.append(SinkState(sink.name, sink.kind, sink.where(), off, position, checkpoint))
    return found


def fork_consequences(job: Job, batch: int | None, checkpoint: Path) -> list[str]:
    """What the job's own sinks do when it goes back to ``batch`` of ``checkpoint``: a sink holding later batches
    drops them (rows deleted by batch id, files out of the log) at the first batch after it, and the replay writes
    them again. The batches named are the sinks' (a migrated line's are counted from its base)."""
    if batch is None:
        return []
    try:
        batch += lineage_base(checkpoint)
    except CheckpointError as exc:
        return [f"The sinks' batches cannot be told: {exc}."]
    lines = []
    for sink in job_sinks(job):
        if sink.off or sink.kind == "results":
            continue
        last = sink.position.last_batch
        if sink.position.error:
            lines.append(f"{sink.name} ({sink.where}): cannot be read now ({sink.position.error}).")
        elif last is None or last <= batch:
            lines.append(f"{sink.name} ({sink.where}): at batch {last if last is not None else '—'}; nothing to undo.")
        elif sink.kind == "kafka":
            lines.append(
                f"{sink.name} ({sink.where}): records of batches {batch + 1}–{last} stay in the topic; the replay "
                "sends them again with the same batch header."
            )
        else:
            what = "rows" if sink.kind == "table" else "files (moved to _statekeeper/rewound)"
            lines.append(
                f"{sink.name} ({sink.where}): at batch {last}; the {what} of batches {batch + 1}–{last} are removed "
                f"when batch {batch + 1} runs, and the replay writes them again."
            )
    return lines
