"""The two ways an operator action ends without doing its work; both messages are for the operator."""


class ActionRefused(Exception):
    """An action that cannot be done now (a run or another action in flight, a job not running); nothing changed."""


class ActionFailed(Exception):
    """The action started but could not be completed."""
