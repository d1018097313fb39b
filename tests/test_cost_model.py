"""Cost model: profile format, monotone prediction, inversion, density model, refit."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from sb_titan.balance.cost_model import (
    AnalyticSpec,
    CostModel,
    DensityModel,
    LatencyObservation,
    Profile,
    ProfileError,
    ProfileNotFoundError,
    block_pairs,
)

BLOCK = 64
LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384]
DENSITIES = [0.05, 0.1, 0.25, 0.5, 1.0]
TOKENS = [1024, 4096, 16384, 65536]
PAIR_S = 2e-7  # attention seconds per computed block pair
TOKEN_S = 1e-6  # token-linear seconds per token
OVERHEAD_S = 1e-3


def attn_formula(length: float, rho: float) -> float:
    """Known truth: a density-independent part (estimator) plus the computed pairs."""
    return float(block_pairs(np.array([length]), BLOCK)[0]) * PAIR_S * (0.1 + 0.9 * rho)


def make_profile(**overrides) -> Profile:
    fields = dict(
        fingerprint={"device_name": "SynthGPU", "torch": "2.13", "dtype": "bfloat16"},
        block_size=BLOCK,
        lengths=list(LENGTHS),
        densities=list(DENSITIES),
        attn_seconds=[[attn_formula(L, r) for r in DENSITIES] for L in LENGTHS],
        linear_tokens=list(TOKENS),
        linear_seconds=[TOKEN_S * t for t in TOKENS],
        overhead_seconds=OVERHEAD_S,
    )
    fields.update(overrides)
    return Profile(**fields)


@pytest.fixture
def model() -> CostModel:
    return CostModel(make_profile())


def truth(doc_lens, rho) -> float:
    return OVERHEAD_S + TOKEN_S * sum(doc_lens) + sum(attn_formula(L, rho) for L in doc_lens)


def test_prediction_reproduces_the_profile_grid(model):
    for L in LENGTHS:
        for r in DENSITIES:
            assert model.predict([L], r) == pytest.approx(truth([L], r), rel=1e-9)
    # Beyond the grid the cost per causal block pair is kept: exact for this formula.
    assert model.predict([65536], 0.5) == pytest.approx(truth([65536], 0.5), rel=1e-9)
    assert model.predict([100], 0.5) == pytest.approx(truth([100], 0.5), rel=1e-9)
    # A micro-batch is the sum of its documents; densities may be per document.
    mixed = model.predict([1024, 4096], [1.0, 0.25])
    expect = OVERHEAD_S + TOKEN_S * 5120 + attn_formula(1024, 1.0) + attn_formula(4096, 0.25)
    assert mixed == pytest.approx(expect, rel=1e-9)
    with pytest.raises(ValueError, match="densities"):
        model.predict([1024, 4096], [1.0])


def test_monotone_in_density_and_length_even_from_a_noisy_profile():
    rng = np.random.default_rng(0)
    noisy = [[attn_formula(L, r) * rng.uniform(0.7, 1.3) for r in DENSITIES] for L in LENGTHS]
    for m in (CostModel(make_profile()), CostModel(make_profile(attn_seconds=noisy))):
        rhos = np.linspace(0.0, 1.0, 41)
        for L in (7, 64, 300, 1000, 3000, 16384, 40000, 131072):
            t = [m.predict([L], r) for r in rhos]
            assert np.all(np.diff(t) >= 0)
        lengths = np.unique(np.geomspace(1, 200_000, 300).astype(int))
        for r in (0.0, 0.07, 0.3, 1.0):
            t = [m.predict([int(L)], r) for L in lengths]
            assert np.all(np.diff(t) >= 0)


@pytest.mark.parametrize("policy", ["topk", "mass"])
def test_inverse_round_trip_within_one_percent(model, policy):
    units = [[[16384]], [[4096] * 4], [[8192, 2048, 512], [16384]], [[256] * 64, [1024] * 16]]
    for unit in units:
        lo = model.predict_budget(unit, 0.1, policy)
        hi = model.predict_budget(unit, 1.0, policy)
        for frac in (0.1, 0.5, 0.9):
            target = lo + frac * (hi - lo)
            sol = model.budget_for(unit, target, policy, 0.1, 1.0)
            assert sol.clamped == 0
            assert sol.predicted_s <= target
            assert model.predict_budget(unit, sol.beta, policy) == pytest.approx(target, rel=0.01)


def test_units_count_the_overhead_once_per_micro_batch(model):
    a, b = [4096, 4096], [8192]
    both = model.predict_budget([a, b], 0.5, "topk")
    assert both == pytest.approx(model.predict(a, 0.5) + model.predict(b, 0.5), rel=1e-12)
    assert model.predict_budget(a, 0.5, "topk") == model.predict_budget([a], 0.5, "topk")


def test_budget_for_flags_clamping_both_ways(model):
    work = [16384]
    slow = model.budget_for(work, 1e-6, "topk", 0.2, 0.9)
    assert (slow.beta, slow.clamped) == (0.2, -1)
    assert slow.predicted_s == pytest.approx(model.predict_budget(work, 0.2, "topk"))
    fast = model.budget_for(work, 100.0, "topk", 0.2, 0.9)
    assert (fast.beta, fast.clamped) == (0.9, 1)
    with pytest.raises(ValueError, match="beta_min"):
        model.budget_for(work, 1.0, "topk", 0.9, 0.2)
    with pytest.raises(ValueError, match="policy"):
        model.budget_for(work, 1.0, "random", 0.2, 0.9)


def test_topk_density_is_beta_above_the_forced_blocks(model):
    assert model.density_for_budget(0.3, 16384, "topk") == 0.3
    # A 2-block document always computes its sink and diagonal: all 3 pairs.
    assert model.density_for_budget(0.3, 128, "topk") == 1.0


def test_fingerprint_mismatch_warns_and_strict_raises(model, caplog):
    same = {"device_name": "SynthGPU", "block_size": BLOCK}
    with caplog.at_level(logging.WARNING):
        assert model.check_fingerprint(same) == []
    assert not caplog.records
    other = {"device_name": "H200", "dtype": "bfloat16", "triton": "3.4"}
    with caplog.at_level(logging.WARNING):
        assert model.check_fingerprint(other) == ["device_name", "triton"]
    text = caplog.text
    assert "device_name" in text and "'SynthGPU'" in text and "'H200'" in text
    assert "triton" in text and "<missing>" in text
    with pytest.raises(ProfileError, match="device_name"):
        model.check_fingerprint(other, strict=True)


SHAPE = {"flavor": "0.5b", "hidden": 896, "layers": 24, "stage_modules": ["layers.0"]}
ENVIRONMENT = {"device_name": "H100", "torch": "2.13.0+cu128", "driver": "570.133.20"}


def test_another_model_shape_is_refused_unless_allowed(caplog):
    """Another shape prices other work: one line naming the file and both shapes; the
    override trains with it, warned."""
    model = CostModel(make_profile(fingerprint={**SHAPE, **ENVIRONMENT}, source="p.json"))
    other = {**SHAPE, **ENVIRONMENT, "layers": 28, "stage_modules": ["layers.0", "layers.1"]}
    with pytest.raises(ProfileError) as refused:
        model.check_fingerprint(other)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("p.json: profile measured for another model shape")
    assert "profile [flavor=0.5b hidden=896 layers=24 stage_modules=['layers.0']]" in line
    assert (
        "this run [flavor=0.5b hidden=896 layers=28 stage_modules=['layers.0','layers.1']]" in line
    )
    with caplog.at_level(logging.WARNING):
        diffs = model.check_fingerprint(other, allow_shape_mismatch=True)
    assert diffs == ["layers", "stage_modules"]
    assert "layers: profile=24 current=28" in caplog.text and "used anyway" in caplog.text


@pytest.mark.parametrize(
    "changed", [{"driver": "570.172.08"}, {"torch": "2.13.1+cu128"}, {"device_name": "H200"}]
)
def test_driver_or_torch_patch_differences_only_warn(changed, caplog):
    model = CostModel(make_profile(fingerprint={**SHAPE, **ENVIRONMENT}, source="p.json"))
    (key,) = changed
    with caplog.at_level(logging.WARNING):
        assert model.check_fingerprint({**SHAPE, **ENVIRONMENT, **changed}) == [key]
    assert f"{key}: profile={ENVIRONMENT[key]!r} current={changed[key]!r}" in caplog.text
    with pytest.raises(ProfileError, match="strict_fingerprint"):  # unless asked to refuse
        model.check_fingerprint({**SHAPE, **ENVIRONMENT, **changed}, strict=True)


def test_profile_save_load_round_trip(tmp_path):
    path = tmp_path / "p.json"
    make_profile().save(path)
    loaded = Profile.load(path)
    assert loaded == make_profile()
    assert loaded.source == str(path)
    assert loaded.digest() == make_profile().digest()


def _write(tmp_path, text: str):
    path = tmp_path / "bad.json"
    path.write_text(text)
    return path


def test_corrupted_and_truncated_files_name_the_file(tmp_path):
    text = json.dumps(make_profile().to_dict())
    for bad in ("{not json", text[: len(text) // 2], "", "[1, 2]"):
        path = _write(tmp_path, bad)
        with pytest.raises(ProfileError, match=str(path)):
            Profile.load(path)
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ProfileError, match=str(path)):
        Profile.load(path)


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("attn_seconds", None, "attn_seconds"),
        ("block_size", "64", "block_size"),
        ("block_size", True, "block_size"),
        ("lengths", [512, 256], "lengths"),
        ("densities", [0.1, 0.5], "densities"),
        ("linear_seconds", [1.0, "x", 2.0, 3.0], "linear_seconds[1]"),
        ("overhead_seconds", -1.0, "overhead_seconds"),
        ("fingerprint", [], "fingerprint"),
        ("version", 99, "version"),
    ],
)
def test_wrong_type_names_file_and_key(tmp_path, key, value, named):
    data = make_profile().to_dict()
    data[key] = value
    path = _write(tmp_path, json.dumps(data))
    with pytest.raises(ProfileError) as err:
        Profile.load(path)
    assert str(path) in str(err.value) and f"'{named}'" in str(err.value)


def test_bad_table_entry_and_missing_key_name_file_and_key(tmp_path):
    data = make_profile().to_dict()
    data["attn_seconds"][2][3] = float("nan")
    path = _write(tmp_path, json.dumps(data))
    with pytest.raises(ProfileError, match=r"'attn_seconds\[2\]\[3\]'"):
        Profile.load(path)
    data = make_profile().to_dict()
    del data["linear_tokens"]
    path = _write(tmp_path, json.dumps(data))
    with pytest.raises(ProfileError, match="missing key 'linear_tokens'") as err:
        Profile.load(path)
    assert str(path) in str(err.value)


def test_missing_profile_points_to_sb_profile_unless_analytic_requested(tmp_path):
    path = tmp_path / "none.json"
    with pytest.raises(ProfileNotFoundError) as err:
        CostModel.from_file(path)
    assert "sb-profile --config <config.toml> --out" in str(err.value)
    assert str(path) in str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    spec = AnalyticSpec(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=2)
    fallback = CostModel.from_file(path, analytic=spec)
    assert fallback.profile.fingerprint["source"] == "analytic"
    make_profile().save(path)
    assert CostModel.from_file(path, analytic=spec).profile == make_profile()


def test_analytic_model_matches_its_flop_count():
    spec = AnalyticSpec(
        hidden=896,
        heads=14,
        kv_heads=2,
        head_dim=64,
        intermediate=4864,
        layers=24,
        peak_flops=1e15,
        attn_efficiency=0.5,
        gemm_efficiency=0.5,
        overhead_seconds=0.0,
    )
    m = CostModel.analytic(spec)
    flops_attn = 14 * 64 * 64 * 64 * 14 * 24 * float(block_pairs(np.array([32768]), 64)[0])
    params = 24 * (896 * 64 * (2 * 14 + 2 * 2) + 3 * 896 * 4864)
    expect = flops_attn / 5e14 + 6 * params * 32768 / 5e14
    assert m.predict([32768], 1.0) == pytest.approx(expect, rel=1e-9)
    # The ideal 1/rho: a sparse kernel at density 0.25 does a quarter of the pairs.
    sparse = m.predict([32768], 0.25) - 6 * params * 32768 / 5e14
    assert sparse == pytest.approx(flops_attn / 4 / 5e14, rel=1e-9)
    with pytest.raises(ValueError, match="attn_efficiency"):
        AnalyticSpec(
            hidden=64,
            heads=4,
            kv_heads=2,
            head_dim=16,
            intermediate=128,
            layers=2,
            attn_efficiency=0.0,
        )


def test_density_model_prior_learning_and_state_dict():
    dm = DensityModel(prior_exponent=1.0)
    betas = np.linspace(0.05, 1.0, 20)
    assert dm.predict(betas, 4096) == pytest.approx(betas)
    # Long documents: attention is concentrated, mass beta needs rho = beta**3.
    obs = [(b, 16384, b**3) for b in betas for _ in range(3)]
    dm.update(obs)
    assert dm.predict(0.5, 16384) == pytest.approx(0.125, rel=1e-6)
    assert dm.predict(0.8, 16384) == pytest.approx(0.512, rel=1e-6)
    # Unobserved lengths borrow the nearest observed shape; monotone in beta everywhere.
    assert dm.predict(0.5, 256) == pytest.approx(0.125, rel=1e-6)
    for L in (64, 1000, 16384, 1 << 20):
        assert np.all(np.diff(dm.predict(np.linspace(0, 1, 101), L)) >= 0)
    clone = DensityModel(prior_exponent=3.0, beta_knots=4)
    clone.load_state_dict(json.loads(json.dumps(dm.state_dict())))
    grid = np.linspace(0.01, 1, 37)
    assert np.array_equal(clone.predict(grid, 3000), dm.predict(grid, 3000))


def test_density_model_is_monotone_under_noise_and_tracks_change():
    dm = DensityModel(max_count=8)
    rng = np.random.default_rng(1)
    noisy = [(b, 4096, float(np.clip(b**2 + rng.normal(0, 0.1), 0.01, 1))) for b in rng.random(400)]
    dm.update(noisy)
    assert np.all(np.diff(dm.predict(np.linspace(0, 1, 201), 4096)) >= 0)
    for _ in range(40):  # attention sharpens: the running means follow (EMA after 8 obs)
        dm.update([(b, 4096, b**4) for b in np.linspace(0.05, 1.0, 20)])
    assert dm.predict(0.5, 4096) == pytest.approx(0.0625, rel=0.02)
    assert dm.predict(0.9, 4096) == pytest.approx(0.6561, rel=0.02)


def test_mass_policy_uses_the_learned_density(model):
    before = model.predict_budget([16384], 0.5, "mass")
    model.density_model.update([(0.5, 16384, 0.1)] * 10)
    assert model.density_for_budget(0.5, 16384, "mass") == pytest.approx(0.1)
    assert model.predict_budget([16384], 0.5, "mass") < before


@pytest.mark.parametrize("policy", ["topk", "mass"])
def test_document_seconds_price_each_document_at_its_own_budget(model, policy):
    """A budget per document: each document's attention at its own beta is the known
    truth at its density, and at one beta the documents sum to the micro-batch's
    prediction less its rest."""
    model.density_model.update([(0.5, 4096, 0.3), (0.8, 16384, 0.6)] * 4)
    model.attn_scale = 1.5
    lens, betas = np.array([4096, 16384, 2048]), np.array([0.5, 0.8, 0.35])
    got = model.document_seconds(lens, betas, policy)
    for n, beta, sec in zip(lens, betas, got, strict=True):
        rho = model.density_for_budget(float(beta), int(n), policy)
        assert sec == pytest.approx(1.5 * attn_formula(n, rho), rel=1e-9)
    assert np.array_equal(
        model.densities(betas, lens, policy)[1:2], model.densities(0.8, lens[1:2], policy)
    )
    rest = OVERHEAD_S + TOKEN_S * lens.sum()
    one = model.document_seconds(lens, 0.5, policy).sum() + rest
    assert one == pytest.approx(model.predict_budget(lens.tolist(), 0.5, policy), rel=1e-12)


def _synthetic_observations(rng, attn_scale, rest_scale, n=16):
    obs = []
    for _ in range(n):
        lens = [int(x) for x in rng.choice(LENGTHS, size=rng.integers(1, 6))]
        rho = [float(x) for x in rng.uniform(0.05, 1.0, len(lens))]
        attn = sum(attn_formula(L, r) for L, r in zip(lens, rho, strict=True))
        rest = OVERHEAD_S + TOKEN_S * sum(lens)
        noise = rng.uniform(0.98, 1.02)
        obs.append(LatencyObservation(lens, rho, (attn_scale * attn + rest_scale * rest) * noise))
    return obs


def test_refit_reduces_error_and_is_deterministic():
    a, b = CostModel(make_profile()), CostModel(make_profile())
    rng = np.random.default_rng(2)
    assert a.drift_warning() is None
    errors = []
    for _ in range(30):
        obs = _synthetic_observations(rng, attn_scale=1.8, rest_scale=0.6)
        a.refit(obs)
        b.refit(list(obs))
        errors.append(a.ape_ema)
    assert a.state_dict() == b.state_dict() and a.digest() == b.digest()
    assert a.attn_scale == pytest.approx(1.8, rel=0.05)
    assert a.rest_scale == pytest.approx(0.6, rel=0.05)
    fresh = _synthetic_observations(np.random.default_rng(3), 1.8, 0.6)
    ape = np.mean([abs(a.predict(o.doc_lens, o.densities) / o.seconds - 1) for o in fresh])
    untuned = CostModel(make_profile())
    ape0 = np.mean([abs(untuned.predict(o.doc_lens, o.densities) / o.seconds - 1) for o in fresh])
    assert ape < 0.03 < ape0 / 3
    assert errors[-1] < errors[0] / 3
    # Early on the error was large: the drift warning fired and named sb-profile.
    c = CostModel(make_profile())
    c.refit(_synthetic_observations(rng, attn_scale=3.0, rest_scale=3.0))
    assert "sb-profile" in c.drift_warning(0.15)
    assert c.drift_warning(10.0) is None


def test_refit_damps_and_ignores_bad_measurements(model):
    model.refit([([4096], 0.5, 0.0), ([4096], 0.5, float("nan"))])
    assert model.n_refits == 0 and model.attn_scale == 1.0
    model.refit([([4096], 0.5, 1e3 * truth([4096], 0.5))])  # one wild outlier
    assert 1.0 < model.attn_scale <= 1.0 + 0.2 * 19  # moves by refit_rate, within bounds
    assert model.rest_scale > 0


def test_cost_model_state_dict_round_trip(model, caplog):
    model.refit(_synthetic_observations(np.random.default_rng(4), 1.5, 0.9))
    model.density_model.update([(0.7, 8192, 0.2)])
    state = json.loads(json.dumps(model.state_dict()))
    other = CostModel(make_profile())
    other.load_state_dict(state)
    assert other.digest() == model.digest()
    assert other.predict_budget([8192], 0.7, "mass") == model.predict_budget([8192], 0.7, "mass")
    # Calibration fit on another profile is dropped (density model kept), with a warning.
    different = CostModel(make_profile(overhead_seconds=2e-3))
    with caplog.at_level(logging.WARNING):
        different.load_state_dict(state)
    assert "another profile" in caplog.text
    assert different.attn_scale == 1.0
    assert different.density_for_budget(0.7, 8192, "mass") == pytest.approx(0.2)
