"""The tiny language model itself: torch only, so a TorchServe handler can carry it.

Imported by the training examples and, inside a model archive, by
``examples/tiny_lm_handler.py``. Nothing here imports Rewind.
"""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

WORDS = [
    "the",
    "a",
    "model",
    "learns",
    "to",
    "predict",
    "next",
    "token",
    "from",
    "context",
    "while",
    "gradients",
    "flow",
    "back",
    "through",
    "layers",
    "of",
    "attention",
    "and",
    "small",
    "feed",
    "forward",
    "blocks",
    "each",
    "step",
    "moves",
    "weights",
    "toward",
    "lower",
    "loss",
    "checkpoints",
    "keep",
    "state",
    "safe",
    "so",
    "training",
    "resumes",
    "exactly",
    "where",
    "it",
    "stopped",
]


def corpus(seed: int = 1234, sentences: int = 4000) -> str:
    """A deterministic synthetic corpus: same text on every machine, nothing to download."""
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        n = rng.randint(4, 12)
        out.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return " ".join(out)


class CharDataset(Dataset):
    def __init__(self, text: str, block: int) -> None:
        chars = sorted(set(text))
        self.vocab = len(chars)
        index = {c: i for i, c in enumerate(chars)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.block = block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block : (i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)
        self.p = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0
        )
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    def __init__(
        self, vocab: int, block: int, dim: int = 64, layers: int = 2, heads: int = 4, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, block, dim))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos[:, : idx.shape[1]])
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def alphabet() -> list[str]:
    """The model's characters, in index order (what CharDataset uses)."""
    return sorted(set(corpus()))


def probes(n: int = 48, seed: int = 99) -> list[dict[str, str]]:
    """Held-out next-character questions (a corpus the model never trained on), for quality gates.

    Each context ends at least three letters into a word, where the vocabulary
    leaves little doubt about the next letter: a trained model gets most right,
    damaged weights almost none.
    """
    text = corpus(seed=seed, sentences=400)
    rng = random.Random(seed)
    out: list[dict[str, str]] = []
    while len(out) < n:
        i = rng.randrange(40, len(text) - 1)
        if text[i - 3 : i].isalpha() and text[i].isalpha():
            out.append({"input": text[i - 31 : i], "expected": text[i]})
    return out


def from_weights(weights: dict[str, torch.Tensor]) -> TinyLM:
    """A model in eval mode holding ``weights``, its architecture read off them (any export of any size)."""
    vocab, dim = weights["tok.weight"].shape
    layers = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("blocks."))
    model = TinyLM(vocab, weights["pos"].shape[1], dim=dim, layers=layers, dropout=0.0)
    model.load_state_dict(weights)
    return model.eval()


def accuracy(model: TinyLM) -> float:
    """The share of ``probes()`` the model answers right: what the quality gate measures through TorchServe."""
    chars = alphabet()
    index = {c: i for i, c in enumerate(chars)}
    right = 0
    with torch.no_grad():
        for p in probes():
            logits = model(torch.tensor([[index[c] for c in p["input"]]]))
            right += chars[int(logits[0, -1].argmax())] == p["expected"]
    return right / len(probes())


def scramble(model: TinyLM, seed: int = 1) -> TinyLM:
    """Shuffle the embedding rows in place: the weights still load and answer, wrongly (a bad model version)."""
    with torch.no_grad():
        perm = torch.randperm(model.tok.weight.shape[0], generator=torch.Generator().manual_seed(seed))
        model.tok.weight.copy_(model.tok.weight[perm])
    return model
