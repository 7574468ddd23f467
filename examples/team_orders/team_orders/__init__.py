"""A team's order-analytics job, packaged for Statekeeper with the SDK only (see ``jobs.py``)."""
