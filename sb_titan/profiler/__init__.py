"""The profiler behind `sb-profile`: one pipeline stage timed on this device over a
grid of (document length, density) and token counts, into the cost model's Profile.

    stage.py        the stage's modules (TorchTitan's split) built alone; stand-ins
    fingerprint.py  what a profile must match to describe a run (the trainer checks it)
    inputs.py       packed rows and attention metadata to time on
    timing.py       clocks and round-robin passes over the grid
    run.py          the grid, the measurement, the Profile and its JSON
"""

from sb_titan.profiler.fingerprint import current_fingerprint, nvidia_driver
from sb_titan.profiler.inputs import (
    AttentionInputs,
    make_attention_step,
    make_stage_step,
    packed_rows,
)
from sb_titan.profiler.run import (
    DEFAULT_DENSITIES,
    ProfileRun,
    ProfileSettings,
    at_nominal,
    default_lengths,
    fit_linear,
    load_cost_model,
    microbatch_rows,
    run_profile,
    write_profile,
)
from sb_titan.profiler.stage import (
    SCOPES,
    ProfilerError,
    TokenLinearAttention,
    attention_kinds,
    attention_swapped,
    build_stage,
    scoped_modules,
    stage_module_names,
)
from sb_titan.profiler.timing import CLOCKS, load_average

__all__ = [
    "CLOCKS",
    "DEFAULT_DENSITIES",
    "SCOPES",
    "AttentionInputs",
    "ProfileRun",
    "ProfileSettings",
    "ProfilerError",
    "TokenLinearAttention",
    "at_nominal",
    "attention_kinds",
    "attention_swapped",
    "build_stage",
    "current_fingerprint",
    "default_lengths",
    "fit_linear",
    "load_average",
    "load_cost_model",
    "make_attention_step",
    "make_stage_step",
    "microbatch_rows",
    "nvidia_driver",
    "packed_rows",
    "run_profile",
    "scoped_modules",
    "stage_module_names",
    "write_profile",
]
