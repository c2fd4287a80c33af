"""The small reference models: cuttable ``nn.Sequential``s of the shapes their docs promise."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gpipe.models import GPTConfig, convnet, gpt, gpt_tied_names, lm_loss, mlp, resnet, unet

SMALL = GPTConfig(vocab_size=32, context=8, d_model=16, n_heads=2, n_layers=2, dropout=0.0)


def test_the_gpt_is_causal_and_its_tie_is_named():
    torch.manual_seed(0)
    model = gpt(SMALL).eval()
    assert len(model) == SMALL.n_layers + 2  # embedding, blocks, head
    ids = torch.randint(0, 32, (2, 8))
    logits = model(ids)
    assert logits.shape == (2, 8, 32)
    later = ids.clone()
    later[:, 5:] = (later[:, 5:] + 1) % 32  # other tokens after position 4
    torch.testing.assert_close(model(later)[:, :5], logits[:, :5])
    y = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(
        lm_loss(logits, y), F.cross_entropy(logits.flatten(0, 1), y.flatten())
    )
    tied = gpt(SMALL, tie_embeddings=True)
    embedding, head = gpt_tied_names(SMALL)
    params = dict(tied.named_parameters(remove_duplicate=False))
    assert params[embedding] is params[head]


def test_the_vision_models_shapes():
    assert len(mlp([4, 8, 3])) == 3 and mlp([4, 8, 3])(torch.randn(2, 4)).shape == (2, 3)
    assert convnet(channels=4, blocks=2)(torch.randn(2, 1, 6, 6)).shape == (2, 10)
    assert resnet(widths=(4, 8), blocks=1)(torch.randn(2, 3, 8, 8)).shape == (2, 10)
    net = unet(channels=4, classes=3)
    assert len(net) == 7 and net(torch.randn(2, 1, 8, 8)).shape == (2, 3, 8, 8)
