"""How a run or a step ends early: raised by the coordinator's parts, caught by its run loop and the CLI."""


class RunAborted(RuntimeError):
    """The run cannot go on (stopped, no node for a stage, a step timed out)."""


class StepFailed(RuntimeError):
    """The step in progress cannot complete under the current plan (a node died, replicas disagree)."""


class ReportRefused(ValueError):
    """A report that contradicts the plan (wrong sender, path or numbers): refused, and nothing changes."""


class Unauthorized(PermissionError):
    """A call about a member that its key did not sign: refused, and nothing changes."""
