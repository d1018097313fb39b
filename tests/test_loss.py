"""The chunked loss the cluster configs train with (TorchTitan's ChunkedLossWrapper,
`[loss] num_chunks`) equals the plain loss: value and gradients of the hidden states and
of the lm_head weight, against an fp64 reference written out by hand."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss

from sb_titan.config.toml import ConfigError, load_config

B, L, D, V = 2, 96, 32, 300


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, D, generator=g)
    w_in = torch.randn(D, D, generator=g) / D**0.5  # a "decoder" in front of the head
    w_head = torch.randn(V, D, generator=g) / D**0.5
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[0, :7] = IGNORE_INDEX  # masked positions (padding, document starts)
    labels[1, -5:] = IGNORE_INDEX
    gvt = (labels != IGNORE_INDEX).sum()
    return x, w_in, w_head, labels, gvt


def _reference(x, w_in, w_head, labels, gvt):
    """fp64, explicit log-softmax: -sum(log p[label]) / valid tokens."""
    x, w_in, w_head = (t.double().requires_grad_() for t in (x, w_in, w_head))
    h = x @ w_in
    logits = h @ w_head.T
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    valid = labels != IGNORE_INDEX
    picked = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    loss = -(picked * valid).sum() / gvt
    loss.backward()
    return loss.detach(), x.grad, w_head.grad


def _run(loss_fn, x, w_in, w_head, labels, gvt, chunked: bool):
    x = x.clone().requires_grad_()
    head = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(w_head)
    h = x @ w_in  # not a leaf: the gradient must flow back through the "decoder"
    if chunked:
        loss_fn.set_lm_head(head)
        loss, _ = loss_fn(h, labels, gvt)
    else:
        loss, _ = loss_fn(head(h), labels, gvt)
    loss.backward()
    return loss.detach(), x.grad, head.weight.grad


@pytest.mark.parametrize("num_chunks", [2, 8, 96])
def test_chunked_loss_equals_plain_loss_and_reference(num_chunks):
    args = _inputs()
    ref_loss, ref_dx, ref_dw = _reference(*args)
    chunked = ChunkedLossWrapper.Config(num_chunks=num_chunks).build()
    plain = CrossEntropyLoss.Config().build()
    for fn, is_chunked in ((chunked, True), (plain, False)):
        loss, dx, dw = _run(fn, *args, chunked=is_chunked)
        assert abs(loss.double() - ref_loss).item() < 1e-6
        torch.testing.assert_close(dx.double(), ref_dx, rtol=0, atol=1e-7)
        torch.testing.assert_close(dw.double(), ref_dw, rtol=0, atol=1e-7)
    c_loss, c_dx, c_dw = _run(chunked, *args, chunked=True)
    p_loss, p_dx, p_dw = _run(plain, *args, chunked=False)
    torch.testing.assert_close(c_loss, p_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(c_dx, p_dx, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(c_dw, p_dw, rtol=1e-5, atol=1e-8)


def test_chunked_loss_never_sees_the_whole_row():
    """The head runs on 1/N of the row at a time: no [B, L, V] logits exist."""
    seen = []
    head = torch.nn.Linear(D, V, bias=False)
    head.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    x, w_in, _, labels, gvt = _inputs()
    fn = ChunkedLossWrapper.Config(num_chunks=8).build()
    fn.set_lm_head(head)
    fn((x @ w_in).requires_grad_(), labels, gvt)[0].backward()
    assert seen == [(B, L // 8, V)] * 8


def test_toml_loss_table_selects_the_loss(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nseq_len = 512\n[loss]\nnum_chunks = 16\n")
    config = load_config(path)
    assert isinstance(config.loss, ChunkedLossWrapper.Config) and config.loss.num_chunks == 16
    assert isinstance(config.loss.loss_fn, CrossEntropyLoss.Config)
    assert load_config(path, ["--loss.num_chunks", "8"]).loss.num_chunks == 8  # CLI wins
    path.write_text("[loss]\nnum_chunks = 1\n")
    assert type(load_config(path).loss) is CrossEntropyLoss.Config


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[loss]\nnum_chunks = 0\n", "'loss.num_chunks' = 0, expected an integer >= 1"),
        ("[loss]\nnum_chunks = 'many'\n", "'loss.num_chunks' = 'many'"),
        ("[loss]\nkind = 'ce'\n", "'loss' must be a table with only 'num_chunks'"),
        (
            "[training]\nseq_len = 1000\n[loss]\nnum_chunks = 16\n",
            "'loss.num_chunks' = 16, expected an integer >= 2 that divides training.seq_len = 1000",
        ),
    ],
)
def test_bad_loss_table_is_one_clear_line(tmp_path, text, needle):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value) and needle in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "name", ["qwen2.5_0.5b_64k", "qwen2.5_3b_128k", "qwen3_4b_128k", "llama3_8b_64k"]
)
def test_cluster_configs_chunk_the_loss(name):
    """~2K tokens per chunk: fp32 logits of one chunk are 1.2 GB, not 40-80 GB a row."""
    config = load_config(REPO / "train_configs" / f"{name}.toml")
    assert isinstance(config.loss, ChunkedLossWrapper.Config)
    assert config.training.seq_len // config.loss.num_chunks == 2048
