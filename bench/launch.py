"""What a launch costs: `./run_train.sh` on the default CPU config with its ranks forked
from one preloaded server (SB_FORK_RANKS=1, the CPU default) against fresh interpreters
(SB_FORK_RANKS=0, what torchrun does and the GPU default).

    python bench/launch.py [--repeats 3] [--steps 3] [--out JSON]

Both ways run interleaved, `--repeats` times each, in alternating order. Per run: wall
seconds and the CPU seconds the whole machine was busy meanwhile (/proc/stat), which
counts every process of the run however it was started; so run it on an otherwise
quiet machine: the cores busy during the 3 s before each run are recorded, and a run
that started with more than 0.2 of a core busy is flagged. The ratio is the median of
the paired ratios (fresh / forked), with their spread.
Writes bench/results/launch.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "launch.json"
WAYS = {"forked": "1", "fresh": "0"}
BUSY_BEFORE = 0.2
"""Cores busy in the 3 s before a run above which the run is flagged as taken under load."""


def busy_cpu_s() -> float:
    """Seconds the machine's CPUs spent outside idle and iowait, since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_once(way: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="sb_launch_bench_") as dump:
        env = dict(os.environ, SB_FORK_RANKS=WAYS[way])
        cmd = ["./run_train.sh", "--dump_folder", dump, "--training.steps", str(steps)]
        idle0 = busy_cpu_s()
        time.sleep(3)
        busy_before = (busy_cpu_s() - idle0) / 3
        cpu0, t0 = busy_cpu_s(), time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - t0, busy_cpu_s() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"bench/launch.py: {way} run failed:\n{proc.stderr[-2000:]}")
    return {"way": way, "wall_s": round(wall, 2), "busy_cpu_s": round(cpu, 2),
            "busy_before": round(busy_before, 2), "loaded": busy_before > BUSY_BEFORE}  # fmt: skip


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    pairs = []
    for r in range(args.repeats):
        order = list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]
        pair = {way: run_once(way, args.steps) for way in order}
        pairs.append(pair)
        print(f"repeat {r + 1}: " + "; ".join(f"{w}: {pair[w]}" for w in WAYS), flush=True)
    summary = {
        way: {k: spread([p[way][k] for p in pairs]) for k in ("wall_s", "busy_cpu_s")}
        for way in WAYS
    }
    ratios = {
        k: spread([p["fresh"][k] / p["forked"][k] for p in pairs]) for k in ("wall_s", "busy_cpu_s")
    }
    out = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "command": f"./run_train.sh --training.steps {args.steps} (train_configs/debug_cpu.toml)",
        "pairs": pairs,
        "summary": summary,
        "fresh_over_forked": ratios,
        "loaded_runs": sum(run["loaded"] for p in pairs for run in p.values()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{os.cpu_count()} CPUs; {out['command']}; runs started with over {BUSY_BEFORE} "
          f"of a core busy: {out['loaded_runs']} of {2 * args.repeats}")  # fmt: skip
    print("| ranks | wall s (median, min-max) | busy CPU s (median, min-max) |")
    print("|---|---|---|")
    for way in WAYS:
        w, c = summary[way]["wall_s"], summary[way]["busy_cpu_s"]
        print(f"| {way} | {w['median']} ({w['min']}-{w['max']}) | "
              f"{c['median']} ({c['min']}-{c['max']}) |")  # fmt: skip
    w, c = ratios["wall_s"], ratios["busy_cpu_s"]
    print(f"| fresh / forked | {w['median']}x ({w['min']}-{w['max']}) | "
          f"{c['median']}x ({c['min']}-{c['max']}) |")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
