"""Reads for the pages, the API and /metrics, one module per subject: jobs, checkpoints (history and summary),
charts, lag, incidents, partitions. Selectors never write; services (dashboard/services/) do."""
