"""How fast the command line answers: whole-process timings of every tool's --help and
of `./run_train.sh --check-config` on the default config.

    python bench/cli.py [--rounds 3] [--baseline DIR] [--label NAME] [--out JSON]

Commands: each console script of pyproject.toml's [project.scripts] with --help (run as
the installed script runs it, `from module import main; main()`, on this checkout),
`./run_train.sh --help` and `./run_train.sh --check-config`. Rounds are interleaved
(every command once per round, in the same order), so a load that comes and goes on a
shared machine falls on all of them alike; with `--baseline DIR` (another checkout, e.g.
a worktree at main) every command also runs there, right after its run here.

Per command: the median and best wall seconds, and the median CPU seconds of the
process and its children (user + system). On a loaded machine the wall time mostly
measures the other load; the CPU time is close to what a quiet machine's wall time
would be. The goal (issue: fast answers): --help <= 3 s, --check-config <= 8 s plus the
dataset and checkpoint checks, on a quiet 2-core machine.
Writes bench/results/cli.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "cli.json"
GOAL_S = {"help": 3.0, "check-config": 8.0}
FLOOR = "python -c 'import torchtitan.trainer'"


def commands(repo: Path) -> dict[str, list[str]]:
    """Name -> argv, run with `repo` as the working directory."""
    scripts = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["scripts"]
    out = {}
    for name, entry in scripts.items():
        module, func = entry.split(":")
        code = f"import sys; from {module} import {func}; sys.exit({func}())"
        out[f"{name} --help"] = [sys.executable, "-c", code, "--help"]
    out["run_train.sh --help"] = ["./run_train.sh", "--help"]
    out["run_train.sh --check-config"] = ["./run_train.sh", "--check-config"]
    # not a command: the floor under --check-config, whose config tree is TorchTitan's
    # Trainer.Config, defined in (and only importable with) this module
    out[FLOOR] = [sys.executable, "-c", "import torchtitan.trainer"]
    return out


def time_once(argv: list[str], cwd: Path) -> dict[str, float]:
    """Wall and CPU seconds (this child and its children) of one run; it must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(cwd))
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"bench/cli.py: {' '.join(argv)} in {cwd} failed: {proc.stderr[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu}


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    walls = [r["wall_s"] for r in runs]
    return {
        "wall_median_s": round(statistics.median(walls), 2),
        "wall_best_s": round(min(walls), 2),
        "cpu_median_s": round(statistics.median(r["cpu_s"] for r in runs), 2),
    }


def table(results: dict[str, dict[str, dict]], labels: list[str]) -> str:
    head = "| command | goal | " + " | ".join(
        f"{label}: wall median / best, CPU median (s)" for label in labels
    )
    lines = [head + " |", "|---|---|" + "---|" * len(labels)]
    for name in results[labels[0]]:
        goal = GOAL_S["check-config" if "check-config" in name else "help"]
        goal_cell = "(floor)" if name == FLOOR else f"<= {goal:g}"
        cells = []
        for label in labels:
            s = results[label][name]["summary"]
            cells.append(f"{s['wall_median_s']} / {s['wall_best_s']}, {s['cpu_median_s']}")
        lines.append(f"| `{name}` | {goal_cell} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--baseline", type=Path, help="another checkout, measured interleaved")
    ap.add_argument("--baseline-label", default="baseline")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    repos = {args.label: REPO}
    if args.baseline is not None:
        repos = {args.baseline_label: args.baseline.resolve(), **repos}
    cmds = commands(REPO)
    runs = {label: {name: [] for name in cmds} for label in repos}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name, argv in cmds.items():
            for label, repo in repos.items():
                runs[label][name].append(time_once(argv, repo))
                print(f"round {r + 1}: {label}: {name}: {runs[label][name][-1]}", flush=True)
        load.append(os.getloadavg()[0])
    results = {
        label: {name: {"runs": rs, "summary": summary(rs)} for name, rs in by_name.items()}
        for label, by_name in runs.items()
    }
    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_1min_per_round": [round(x, 2) for x in load],
    }
    out = {
        "machine": machine,
        "rounds": args.rounds,
        "repos": {k: str(v) for k, v in repos.items()},
    }
    out["results"] = results
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    per_round = machine["load_1min_per_round"]
    print(f"\n{os.cpu_count()} CPUs, 1-minute load average per round: {per_round}")
    print(table(results, list(repos)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
