"""The layers that communicate: row-parallel linear, vocabulary-parallel embedding and LM head.

Each factory returns the plain torch module when there is no tensor-parallel group, so a
single-device model is exactly what it was.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infer8.distributed.parallel_state import TensorParallelGroup
from infer8.utils import cdiv


class RowParallelLinear(nn.Linear):
    """A bias-free linear layer over this rank's slice of the input features, summed over ranks."""

    def __init__(self, in_features: int, out_features: int, group: TensorParallelGroup) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project the local slice and all-reduce the partial sums."""
        return self.after_matmul(F.linear(x, self.weight))

    def after_matmul(self, y: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial products (also used by a packed CPU copy of this layer)."""
        return self.group.all_reduce(y)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding table; each token's row comes from the rank holding it."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup) -> None:
        rows = cdiv(vocab_size, group.world_size)
        super().__init__(rows, hidden_size)
        self.vocab_start = group.rank * rows
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Look up the local ids, zero the others, all-reduce."""
        local_ids = input_ids - self.vocab_start
        is_local = (local_ids >= 0) & (local_ids < self.num_embeddings)
        out = F.embedding(local_ids.clamp(0, self.num_embeddings - 1), self.weight)  # [n, hidden]
        out.masked_fill_(~is_local.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)


class ParallelLMHead(nn.Linear):
    """This rank's vocabulary rows of the LM head; the logits are gathered from every rank."""

    def __init__(self, hidden_size: int, vocab_size: int, group: TensorParallelGroup) -> None:
        super().__init__(hidden_size, cdiv(vocab_size, group.world_size), bias=False)
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits [n, vocab_size]: local rows, gathered, padding cut off."""
        return self.after_matmul(F.linear(x, self.weight))

    def after_matmul(self, y: torch.Tensor) -> torch.Tensor:
        """Gather the ranks' logits and cut the padding (also used by a packed CPU copy)."""
        return self.group.all_gather(y)[..., : self.vocab_size]


def row_parallel_linear(
    in_features: int, out_features: int, group: TensorParallelGroup | None
) -> nn.Linear:
    """Return a bias-free output projection (o_proj, down_proj), row-parallel under a group."""
    if group is None:
        return nn.Linear(in_features, out_features, bias=False)
    return RowParallelLinear(in_features, out_features, group)


def vocab_embedding(
    vocab_size: int, hidden_size: int, group: TensorParallelGroup | None
) -> nn.Embedding:
    """Return the token embedding, vocabulary-parallel under a group."""
    if group is None:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, group)


def lm_head(hidden_size: int, vocab_size: int, group: TensorParallelGroup | None) -> nn.Linear:
    """Return the LM head, vocabulary-parallel under a group."""
    if group is None:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(hidden_size, vocab_size, group)
