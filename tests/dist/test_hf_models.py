"""Models from HuggingFace transformers (random init, tiny configs, nothing downloaded):
ViT and GPT-2 trace and replay equal to eager, and BERT masked-LM runs on a data-parallel mesh
equal to one process (its trace is the mesh's; each model's trace takes seconds, so each is
traced once).

Tolerances: the replay runs the traced aten ops on one process in eager's order, so losses
and parameters are bit-equal (rtol 0, atol 0). The mesh sums gradients across 2 ranks in
another order: rtol 1e-5 / atol 1e-6 on losses, atol 1e-5 on parameters (AdamW divides the
rounding noise of ~0 gradients by itself; a wrong shard is off by ~lr = 1e-3 per step), as in
``test_distribute.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import meshplan

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

_QUIET = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _bert():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32, **_QUIET)
    return (transformers.BertForMaskedLM(cfg),
            lambda m, a, b: m(input_ids=a, labels=b).loss,
            lambda g: (torch.randint(0, 64, (4, 16), generator=g),
                       torch.randint(0, 64, (4, 16), generator=g)))


def _vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                 num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, num_labels=5, **_QUIET)
    return (transformers.ViTForImageClassification(cfg),
            lambda m, a, b: m(pixel_values=a, labels=b).loss,
            lambda g: (torch.randn(4, 3, 16, 16, generator=g),
                       torch.randint(0, 5, (4,), generator=g)))


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return (transformers.GPT2LMHeadModel(cfg),
            lambda m, a, b: m(input_ids=a, labels=b).loss,
            lambda g: (torch.randint(0, 64, (4, 16), generator=g),
                       torch.randint(0, 64, (4, 16), generator=g)))


def _pair(make):
    """The user's program twice from one seed: (model, step) for meshplan and for eager."""
    torch.manual_seed(0)
    model, loss_of, batch = make()
    out = []
    for m in (model, copy.deepcopy(model)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)

        def step(a, b, m=m, opt=opt):
            loss = loss_of(m, a, b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        out.append((m, step))
    return out, batch


@pytest.mark.parametrize("make", [_vit, _gpt2], ids=["vit", "gpt2"])
def test_traces_and_replays_equal_to_eager(make) -> None:
    ((m1, step), (m2, eager)), batch = _pair(make)
    g = torch.Generator().manual_seed(1)
    traced = meshplan.trace(step, *batch(g))
    for i in range(2):
        a, b = batch(g)
        torch.testing.assert_close(traced(a, b), eager(a, b), rtol=0, atol=0, msg=f"call {i}")
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_bert_on_a_data_parallel_mesh() -> None:
    ((m1, step), (m2, eager)), batch = _pair(_bert)
    g = torch.Generator().manual_seed(2)
    with meshplan.distribute(step, mesh={"dp": 2}, strategy="dp", telemetry=False) as dist:
        for i in range(2):
            a, b = batch(g)
            torch.testing.assert_close(dist(a, b), eager(a, b), rtol=1e-5, atol=1e-6,
                                       msg=f"call {i}")
        dist.sync()
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=name)
