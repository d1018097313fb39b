"""Plans and DST budgets for fixed seeds are what they were when recorded
(scripts/plan_digests.py): refactorings that must not change behaviour are checked here.
Re-record with `python scripts/plan_digests.py --out tests/fixtures/plan_digests.json`
only for a change that is meant to alter plans or budgets, and say so in the commit.
The trainer's own plans and budgets (2-rank torchrun runs, SAB + DST, the refit on the
deterministic clock) are held the same way by the runs that train them:
conftest.assert_run_digest, tests/fixtures/run_digests.json."""

from __future__ import annotations

import importlib.util
import json

from conftest import REPO

RECORDED = REPO / "tests" / "fixtures" / "plan_digests.json"


def test_plans_and_budgets_match_the_recorded_digests():
    spec = importlib.util.spec_from_file_location("digests", REPO / "scripts" / "plan_digests.py")
    digests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digests)
    now = {**digests.packing_digests(), **digests.simulate_digests()}
    recorded = json.loads(RECORDED.read_text())
    assert set(now) == set(recorded)
    changed = {k: (recorded[k], now[k]) for k in recorded if recorded[k] != now[k]}
    assert not changed, changed
