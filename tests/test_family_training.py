"""Each model family trains from its own Hugging Face checkpoint on 2 real torchrun
ranks (gloo): FSDP, SAB + DST, sparse attention. Its export, made from the run's own
record (no --config), loads and generates in transformers.

One run per family: Qwen2.5 with YaRN (the Qwen2.5 family and the attention factor in
one run), Qwen3 (QK-norm, head_dim set apart from hidden / heads) and Llama 3 with its
RoPE scaling. The logits of each family against transformers are checked in
tests/test_hf_interop.py; here, that the whole recipe runs on them.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import DEBUG_HF_SHAPE, losses, sample_log, tiny_hf, torchrun

pytestmark = pytest.mark.torchrun

# model_type and config overrides of each family's tiny checkpoint (the debug flavor's
# widths; training.seq_len is 512)
FAMILY_RUNS = {
    "qwen2_5_yarn": (
        "qwen2",
        {
            "max_position_embeddings": 2048,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 512,
            },
        },
    ),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
}


@pytest.mark.parametrize("family", list(FAMILY_RUNS))
def test_family_trains_from_its_checkpoint_and_exports(family, tmp_path):
    model_type, overrides = FAMILY_RUNS[family]
    hf = tmp_path / "hf"
    tiny_hf(hf, model_type, False, **{**DEBUG_HF_SHAPE, **overrides})
    dump = tmp_path / "run"
    args = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(hf)]
    args += ["--checkpoint.initial_load_in_hf", "--model.flavor", "hf"]
    args += ["--sab.policy", "sab", "--dst.enabled", "--cost_model.analytic_device", "cpu"]
    args += ["--dataloader.sample_log", "--training.steps", "3", "--checkpoint.interval", "3"]
    torchrun(2, args, dump)

    loss = losses(dump)
    assert len(loss) == 3 and all(math.isfinite(x) for x in loss), loss
    for rank in (0, 1):  # DST gave every micro-batch a budget of its own, below dense
        budgets = [entry["budget"] for entry in sample_log(dump, rank)]
        assert len(budgets) == 3 and all(0 < b < 1 for b in budgets), budgets

    from sb_titan.tools.export import main as export_main

    out = tmp_path / "export"
    export_main(["--checkpoint", str(dump / "checkpoint"), "--out", str(out)])
    before, after = (json.loads((d / "config.json").read_text()) for d in (hf, out))
    assert after["model_type"] == model_type
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers"):
        assert after[key] == before[key], key
    head_dim = [
        c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"] for c in (before, after)
    ]
    assert head_dim[0] == head_dim[1], head_dim
    # the RoPE scaling it was given (the export spells out YaRN's defaults too)
    given = before["rope_parameters"]
    assert {k: after["rope_parameters"].get(k) for k in given} == given

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    initial = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    prompt = torch.tensor([[5, 17, 42, 7, 99, 3]])
    with torch.no_grad():
        trained_logits, initial_logits = model(prompt).logits, initial(prompt).logits
        generated = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert not torch.allclose(trained_logits, initial_logits)  # the run's weights, trained
    assert generated.shape == (1, 10) and torch.equal(generated[:, :6], prompt)
