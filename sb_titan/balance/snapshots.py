"""Cost-model snapshots, lagged by a fixed number of steps, for planning ahead.

The loader plans step t (SAB packing and DST budgets) in its prefetch thread while
the trainer still runs earlier steps and refits the cost model after each. Planning
with whatever model happens to be current would make plans depend on thread timing;
so step t is planned with the model as it stood after the trainer finished step
t - lag (the initial model for t < lag), which every rank holds bit for bit (the
refit is computed from one all-gathered tensor). With lag >= 1 every snapshot a plan
waits for comes from a step whose micro-batches were all produced before that plan
began, so the wait never deadlocks; with lag >= 2 it also never stalls training
while the planning thread keeps up (docs/training.md).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sb_titan.balance.cost_model import CostModel

logger = logging.getLogger(__name__)

_WAIT_POLL_S = 0.05  # how often a waiting planner checks whether it was cancelled
_WAIT_WARN_S = 60.0  # a planner still waiting after this long says what it waits for


class PlanningCancelled(RuntimeError):
    """The waiting planner's loader was reset or closed; its work is no longer wanted."""


class CostModelSnapshots:
    """Published cost models by the step after which they were taken.

    `publish(s, model)` after training plan step s (every step, once, in order);
    `model_for(t)` returns the snapshot plans of step t use: published after step
    t - lag. Only the snapshots a future or re-planned step can still need are kept,
    and they are what the checkpoint stores (`state_dict`), so resume re-plans with
    exactly the models the interrupted run used.
    """

    def __init__(self, initial: CostModel, lag: int) -> None:
        if lag < 1:
            raise ValueError(f"cost_model.plan_lag: must be >= 1 (got {lag})")
        self.lag = lag
        self._template = copy.deepcopy(initial)
        self._initial = copy.deepcopy(initial)
        self._models: dict[int, CostModel] = {}  # trained step -> model after it
        self._published = -1  # last trained step published
        self._closed = False
        self._cond = threading.Condition()

    def source_step(self, step: int) -> int:
        """The trained step whose model plans `step` (-1: the initial model)."""
        return max(step - self.lag, -1)

    def publish(self, trained_step: int, model: CostModel) -> None:
        """The model as refit after training plan step `trained_step`. Drops snapshots
        no plan from `trained_step + 1` on can still need."""
        snapshot = copy.deepcopy(model)
        with self._cond:
            if trained_step <= self._published:
                raise RuntimeError(
                    f"cost-model snapshot for step {trained_step} published after step "
                    f"{self._published}: steps must publish once, in order"
                )
            self._models[trained_step] = snapshot
            self._published = trained_step
            oldest = self.source_step(trained_step + 1)
            for step in [s for s in self._models if s < oldest]:
                del self._models[step]
            self._cond.notify_all()

    def model_for(self, step: int, cancelled: Callable[[], bool] = lambda: False) -> CostModel:
        """The snapshot that plans `step`, waiting until the trainer has published it.
        Raises PlanningCancelled if `cancelled()` turns true or the store is closed."""
        source = self.source_step(step)
        if source < 0:
            return self._initial
        started = warned = time.monotonic()
        with self._cond:
            while self._published < source:
                if self._closed or cancelled():
                    raise PlanningCancelled(f"planning step {step} cancelled")
                self._cond.wait(_WAIT_POLL_S)
                now = time.monotonic()
                if now - warned > _WAIT_WARN_S:
                    warned = now
                    logger.warning(
                        "planning step %d has waited %.0f s for the cost model after "
                        "step %d (last published: %d)",
                        step,
                        now - started,
                        source,
                        self._published,
                    )
            if source not in self._models:
                raise RuntimeError(
                    f"cost-model snapshot after step {source} (for planning step {step}) "
                    f"was already dropped; kept: {sorted(self._models)}"
                )
            return self._models[source]

    def rebuild(self, step: int) -> CostModel:
        """A fresh model from the serialized snapshot that plans `step` (what a resumed
        run would use); the trainer checks plans against it under dst.verify_ranks."""
        model = copy.deepcopy(self._template)
        model.load_state_dict(json.loads(json.dumps(self.model_for(step).state_dict())))
        return model

    def close(self) -> None:
        """Wake every waiting planner with PlanningCancelled (loader shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def adopt(self, model: CostModel, trained_step: int) -> None:
        """After loading a checkpoint that holds no snapshots (written before they
        existed): the checkpoint's model plans every step still pending."""
        with self._cond:
            first = self.source_step(trained_step + 1)
            self._models = {s: copy.deepcopy(model) for s in range(max(first, 0), trained_step + 1)}
            self._published = trained_step
            self._cond.notify_all()

    # -- checkpointing
    def state_dict(self) -> dict[str, Any]:
        with self._cond:
            return {
                "lag": self.lag,
                "published": self._published,
                "models": {str(s): m.state_dict() for s, m in self._models.items()},
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["lag"] != self.lag:
            raise ValueError(
                f"checkpoint planned with cost_model.plan_lag = {state['lag']}, but the "
                f"config has {self.lag}: plans after resume would differ"
            )
        models = {}
        for step, model_state in state["models"].items():
            model = copy.deepcopy(self._template)
            model.load_state_dict(model_state)
            models[int(step)] = model
        with self._cond:
            self._models = models
            self._published = int(state["published"])
            self._cond.notify_all()
