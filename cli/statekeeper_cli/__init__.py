"""The ``statekeeper`` command: jobs as code through the console's API (``statekeeper_cli.main``)."""

__version__ = "1.0.0"
