"""The ways an operator action ends without doing its work; every message is for the operator."""


class ActionRefused(Exception):
    """An action that cannot be done now (a run or another action in flight, a job not running); nothing changed."""


class ActionFailed(Exception):
    """The action started but could not be completed."""


class ActionAborted(ActionFailed):
    """The action stopped by design before it changed the job (an operator's abort, or a rule it gives up by): it
    ends ``aborted``, not ``failed``, so a script can tell the two apart."""
