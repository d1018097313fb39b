"""The cluster simulator behind `sb-simulate`: SAB and DST at 8-1024 GPUs, replayed on
a CPU with the project's own planner, DST and cost model (docs/simulate.md).

    cluster.py    the DP x PP shape, schedule and network
    schedules.py  per-stage action orders (torch.distributed.pipelining's own)
    replay.py     event-level replay of one pipeline step
    stages.py     each stage's cost model, split as TorchTitan splits the model
    step.py       one step of one variant: plan, budget, time, replay, reduce
    run.py        every variant over the same documents for many steps
    context.py    `--cp N`: DP x CP groups, dense/sparse attention on zigzag/balanced splits
    heldout.py    `--recall-curves`: recall scored by measured curves held out from DST's
    report.py     JSON, markdown table, Gantt chart
"""

from sb_titan.simulator.cluster import SCHEDULES, Cluster, Network, Scenario
from sb_titan.simulator.report import format_table, plot_timelines, report
from sb_titan.simulator.run import build_simulator, draw_lengths, simulate
from sb_titan.simulator.step import VARIANTS, Simulator, StepResult, make_balancer

__all__ = [
    "SCHEDULES",
    "VARIANTS",
    "Cluster",
    "Network",
    "Scenario",
    "Simulator",
    "StepResult",
    "build_simulator",
    "draw_lengths",
    "format_table",
    "make_balancer",
    "plot_timelines",
    "report",
    "simulate",
]
