"""The SDK's private runtime: what the console and the test kit run on a pipeline's behalf (the events' checks,
the schema checker, the upgrade verdict, a migration's reading and building of state). Not a published API: a pipeline
imports ``statekeeper_sdk`` and ``statekeeper_sdk.testing``; names here change without a deprecation."""
