"""Small models and data shared by the numerics and accuracy benchmarks.

Two tasks, both generated or bundled locally (no download):

- **digits**: sklearn's 8x8 handwritten digits (1437 train / 360 test
  images) and :class:`DigitsCNN` (53k parameters), the model of
  :mod:`benchmarks.simulate_training`.
- **markov**: next-token prediction on sequences drawn from a random
  second-order Markov chain over a small vocabulary (the next token depends
  on the previous two, so the model has to attend beyond the last token),
  and :class:`TinyLM`, a small causal transformer (2 blocks; 26k parameters at
  width 32, 104k at width 64).
  :func:`markov_data` also returns the oracle: the loss and token accuracy
  of the true chain on the test set, the best any model can do.

Example:
    >>> x_tr, y_tr, x_te, y_te = load_digits_tensors()
    >>> DigitsCNN()(x_te[:2]).shape
    torch.Size([2, 10])
    >>> data = markov_data(vocab=16, seq_len=32, n_train=64, n_test=16, seed=0)
    >>> TinyLM(vocab=16, seq_len=32)(data.x_train[:2]).shape
    torch.Size([2, 32, 16])
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from benchmarks.simulate_training import DigitsCNN, load_digits_tensors

__all__ = [
    "DigitsCNN",
    "MarkovData",
    "TinyLM",
    "lm_loss",
    "load_digits_tensors",
    "markov_data",
]


@dataclasses.dataclass
class MarkovData:
    """Train and test token sequences of a second-order Markov chain.

    Attributes:
        x_train: inputs, shape (n_train, seq_len), int64 tokens.
        y_train: targets (the inputs shifted by one), same shape.
        x_test: test inputs.
        y_test: test targets.
        oracle_loss: mean cross-entropy (nats/token) of the true chain on the
            test targets, positions 2 and later (the first two have no full context).
        oracle_acc: token accuracy of the true chain's most likely next token
            on the same positions.
        vocab: vocabulary size.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    oracle_loss: float
    oracle_acc: float
    vocab: int


def markov_data(
    vocab: int = 16,
    seq_len: int = 32,
    n_train: int = 4096,
    n_test: int = 512,
    seed: int = 0,
    concentration: float = 0.2,
) -> MarkovData:
    """Sample sequences from a random second-order Markov chain.

    The transition table ``P[a, b, :]`` (next-token distribution after the
    pair ``a, b``) is drawn from a symmetric Dirichlet: a small
    ``concentration`` gives peaked, learnable distributions.

    Args:
        vocab: vocabulary size V.
        seq_len: tokens per training example (sequences are ``seq_len + 1``
            long: inputs and shifted targets).
        n_train: training sequences.
        n_test: test sequences.
        seed: seed of the chain and the samples (the same seed gives the same data).
        concentration: Dirichlet parameter of every row of the table.

    Returns:
        A :class:`MarkovData`.

    Example:
        >>> d = markov_data(vocab=8, seq_len=16, n_train=32, n_test=8)
        >>> d.x_train.shape, 0.0 < d.oracle_acc <= 1.0
        (torch.Size([32, 16]), True)
    """
    gen = torch.Generator().manual_seed(seed)
    alpha = torch.full((vocab,), concentration)
    gamma = torch._standard_gamma(alpha.expand(vocab, vocab, vocab).contiguous(), generator=gen)
    table = gamma / gamma.sum(-1, keepdim=True)
    total = n_train + n_test
    seqs = torch.empty(total, seq_len + 1, dtype=torch.int64)
    seqs[:, :2] = torch.randint(0, vocab, (total, 2), generator=gen)
    for t in range(2, seq_len + 1):
        probs = table[seqs[:, t - 2], seqs[:, t - 1]]
        seqs[:, t] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    x, y = seqs[:, :-1], seqs[:, 1:]
    test = seqs[n_train:]
    # Oracle on targets at positions t >= 2 of the full sequence (inputs 1.. of x).
    ctx = table[test[:, :-2], test[:, 1:-1]]  # (n_test, seq_len - 1, V)
    target = test[:, 2:]
    oracle_loss = float(-ctx.gather(-1, target.unsqueeze(-1)).log().mean())
    oracle_acc = float((ctx.argmax(-1) == target).float().mean())
    return MarkovData(
        x[:n_train], y[:n_train], x[n_train:], y[n_train:], oracle_loss, oracle_acc, vocab
    )


class _Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        # Plain ops (no fused kernel) so that torch.func.vmap works for the simulator.
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // h)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    """A small causal transformer language model (GPT-style, pre-norm).

    Args:
        vocab: vocabulary size.
        seq_len: longest input (learned positional embeddings).
        dim: model width.
        depth: number of blocks.
        heads: attention heads.

    Example:
        >>> TinyLM(16, 32)(torch.zeros(3, 32, dtype=torch.int64)).shape
        torch.Size([3, 32, 16])
    """

    def __init__(
        self, vocab: int = 16, seq_len: int = 32, dim: int = 64, depth: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[-1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position.

    Example:
        >>> lm_loss(torch.zeros(2, 4, 8), torch.zeros(2, 4, dtype=torch.int64)).item() > 0
        True
    """
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
