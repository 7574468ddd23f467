"""An example of a pipeline package that Statekeeper operates without knowing it: see ``pipelines.py``."""
