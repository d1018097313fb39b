"""The measurement exchange's cost on real gloo ranks: encode one step's measurements,
one all-gather of the fixed-size float64 buffer, decode (sb_titan.runtime.measurements).

bench/control_plane.py reports it beside its table (`measure_exchange`); this file is
also what each torchrun rank runs, kept apart so that a rank imports torch and the
measurement codec only (~4 CPU s), not the simulator and TorchTitan that the control
plane's planning imports (~13 CPU s per interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def exchange_worker(microbatches: int, repeats: int) -> None:
    """One torchrun rank: time encode + all_gather_flat + decode of a step's measurements
    (`microbatches` timed, with stats); rank 0 prints the median seconds as JSON."""
    import torch.distributed as dist

    from sb_titan.runtime.measurements import (
        all_gather_flat,
        decode_measurements,
        encode_measurements,
    )

    dist.init_process_group("gloo")
    rng = random.Random(dist.get_rank())
    local = {
        "dp": dist.get_rank(),
        "pp": 0,
        "seconds": {mb: rng.random() for mb in range(microbatches)},
        # STATS_FIELDS: density, rows, recall and tokens, then the sampled true recall,
        # top-key hits and samples
        "stats": {
            mb: [rng.random(), 1.0, rng.random(), 64.0, rng.random(), 1.0, 4.0]
            for mb in range(microbatches)
        },
        "step_seconds": 1.0,
    }
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        decode_measurements(all_gather_flat(encode_measurements(local, microbatches)), microbatches)
        times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        print(json.dumps({"median_s": statistics.median(times), "repeats": repeats}))
    dist.destroy_process_group()


def measure_exchange(ranks: int, microbatches: int, repeats: int = 200) -> dict:
    """The exchange on `ranks` real gloo processes (torchrun, one host)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={ranks}", __file__, str(microbatches), str(repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"exchange on {ranks} ranks failed:\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"ranks": ranks, "microbatches": microbatches, **result}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="one rank of the timed exchange (torchrun)")
    ap.add_argument("microbatches", type=int)
    ap.add_argument("repeats", type=int)
    args = ap.parse_args()
    exchange_worker(args.microbatches, args.repeats)
