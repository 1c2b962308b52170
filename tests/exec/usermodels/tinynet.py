"""A user's own architecture, given to SpiderFlow as the entry point
``tests.exec.usermodels.tinynet:build`` (importable from the repository root):
an embedding, four residual MLP-mixer blocks and a head."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, HIDDEN, LAYERS = 64, 32, 4


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.cumsum(x, dim=1) / torch.arange(1, x.shape[1] + 1, device=x.device)[None, :, None]
        return x + self.down(torch.relu(self.up(self.norm(causal))))


def build() -> tuple[nn.Module, list[nn.Module], nn.Module]:
    return nn.Embedding(VOCAB, HIDDEN), [Mix() for _ in range(LAYERS)], nn.Linear(HIDDEN, VOCAB)
