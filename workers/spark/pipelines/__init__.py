"""The pipelines Statekeeper ships, one module each, each ending in its ``PIPELINE`` record. They are examples: the
console finds them the way it finds a user's (``settings.PIPELINES``), never by importing this package."""
