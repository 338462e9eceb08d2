"""How a run or a step ends early: raised by the coordinator's parts, caught by its run loop and the CLI."""


class RunAborted(RuntimeError):
    """The run cannot go on (stopped, no node for a stage, a step timed out)."""


class StepFailed(RuntimeError):
    """The step in progress cannot complete under the current plan (a node died, replicas disagree)."""
