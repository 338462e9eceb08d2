"""Stage state a node keeps after a new plan moved it to other layers, until those layers have their new holders.

A plan epoch may move a node's layers to another node and give it other layers (after a coordinator restart the
planner swapped two nodes' stages: each dropped its state before the other had fetched it, and the run waited
through two step timeouts). So a node lets go of a layer range only once no one can still need it: it keeps the
runtime it held, at its committed step, and serves FetchState from it until the run has committed past that step
(the node applies a newer step, or a plan says the run stands at another step). A later plan that gives the node
those layers back takes the kept copy instead of starting afresh.
"""

from __future__ import annotations

from geotrain.node.stage import StageRuntime

LayerRange = tuple[int, int]


class HeldStates:
    """Runtimes of layer ranges this node no longer serves, each at the committed step it held; not thread-safe
    (the agent calls it under its state lock)."""

    def __init__(self) -> None:
        self._held: dict[LayerRange, StageRuntime] = {}

    def keep(self, runtime: StageRuntime, steps_done: int) -> None:
        """Keep a runtime the node is moving away from if it holds the run's committed step (steps_done); one that
        never applied a step is the seed's, which any node rebuilds."""
        if runtime.applied_step >= 0 and runtime.applied_step + 1 == steps_done:
            runtime.reset_step()  # its uncommitted gradients and activations belong to an abandoned epoch
            self._held[(runtime.start, runtime.end)] = runtime

    def take(self, layers: LayerRange, steps_done: int) -> StageRuntime | None:
        """The kept runtime of `layers` at steps_done, handed back to serve (no longer kept here), or None."""
        runtime = self.get(layers, steps_done)
        if runtime is not None:
            del self._held[layers]
        return runtime

    def get(self, layers: LayerRange, steps_done: int) -> StageRuntime | None:
        """The kept runtime of `layers` if it holds the state after steps_done steps, else None."""
        runtime = self._held.get(layers)
        return runtime if runtime is not None and runtime.applied_step + 1 == steps_done else None

    def release_except(self, steps_done: int) -> None:
        """Let go of every copy not at steps_done: the run has committed past it (or rolled back to a checkpoint)."""
        self._held = {k: r for k, r in self._held.items() if r.applied_step + 1 == steps_done}
