"""Per-stage action orders, taken from torch.distributed.pipelining's own schedules
where they exist, so the replay runs micro-batches in the order a real run would."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Action:
    kind: str  # "F" | "B" (full backward)
    stage: int  # global stage index; it runs on pipeline rank stage % pp
    mb: int


def _single_stage_order(schedule: str, pp: int, m: int, stage: int) -> list[Action]:
    """GPipe: every forward, then every backward. 1F1B as torch's Schedule1F1B runs it:
    min(m, pp - stage) warm-up forwards, then backward/forward pairs, then cool-down."""
    if schedule == "GPipe":
        return [Action(k, stage, i) for k in "FB" for i in range(m)]
    warmup = min(m, pp - stage)
    order = [Action("F", stage, i) for i in range(warmup)]
    for i in range(m):
        order.append(Action("B", stage, i))
        if warmup + i < m:
            order.append(Action("F", stage, warmup + i))
    return order


def schedule_orders(
    schedule: str, pp: int, microbatches: int, virtual: int = 1
) -> list[list[Action]]:
    """Per pipeline rank, its compute actions in the order the schedule runs them.

    1F1B and GPipe follow torch.distributed.pipelining's runtime loops (their IR
    generator `_get_pipeline_order` is off by one on the last stage in torch 2.13);
    Interleaved1F1B is torch's own `_calculate_single_rank_operations`, the order its
    runtime executes, built without stages or process groups. Without PP: gradient
    accumulation, forward then backward per micro-batch.
    """
    if pp == 1:
        return [[Action(k, 0, i) for i in range(microbatches) for k in "FB"]]
    if schedule in ("1F1B", "GPipe"):
        return [_single_stage_order(schedule, pp, microbatches, s) for s in range(pp)]
    from sb_titan.compat.pipelining import interleaved_1f1b_order

    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        raise ValueError(
            f"Interleaved1F1B needs microbatches ({microbatches}) to be a multiple of "
            f"max(1, microbatches // pp) = {rounds}"
        )
    orders = [
        [Action(*a) for a in rank]
        for rank in interleaved_1f1b_order(pp, virtual, microbatches, rounds)
    ]
    expected = {(k, s, i) for k in "FB" for s in range(pp * virtual) for i in range(microbatches)}
    got = [(a.kind, a.stage, a.mb) for order in orders for a in order]
    if len(got) != len(expected) or set(got) != expected:
        raise RuntimeError(f"torch's Interleaved1F1B order (pp={pp}, m={microbatches}) is invalid")
    return orders


def closed_form_step_s(schedule: str, microbatches: int, pp: int, t: float, virtual: int = 1):
    """Balanced pipeline, t = fwd+bwd of one micro-batch on one rank, no send latency."""
    if schedule == "Interleaved1F1B":
        return (microbatches + (pp - 1) / virtual) * t
    return (microbatches + pp - 1) * t
