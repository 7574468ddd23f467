"""The console's engine for what a pipeline declares: its sinks written exactly once (``sinks``), the code version
of a deploy (``code``), and sample events made from its generator, samples file or payload (``samples``). Django-free, as ``dashboard/checkpoint_dir`` is: the drivers (``workers/``) and the pages
(``dashboard/``) both use it; the SDK (``statekeeper_sdk``) holds the declarations only."""
