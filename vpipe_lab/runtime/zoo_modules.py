"""The paper-sized models of :mod:`vpipe_lab.runtime.zoo`, written op by op as their reference code is.

Attention, layer norm and cells are spelled out operator by operator (as the reference
implementations the vPipe paper profiled do), so their fx traces have the structure the
partitioner must cope with: dense subgraphs inside blocks, residual edges, and long
"sparse" edges (the attention mask feeding every BERT layer, the encoder output feeding
every decoder layer, AmoebaNet's previous-previous cell input).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BertLike", "EncoderDecoder", "AmoebaNetLike", "GnmtLike"]


# --------------------------------------------------------------------- transformer parts
class LayerNorm(nn.Module):
    """Layer norm with its affine part written out (normalise, scale, shift)."""

    def __init__(self, dim: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.dim, self.eps = dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), eps=self.eps) * self.weight + self.bias


class Gelu(nn.Module):
    """BERT's erf GELU, op by op as in its reference code."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class Attention(nn.Module):
    """Multi-head attention spelled out: projections, score matmul, mask, softmax, context."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.drop = nn.Dropout(dropout)

    def _split(self, x: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        return x.view(batch, seq, self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor, batch: int,
                seq: int) -> torch.Tensor:
        q = self._split(self.q(x), batch, seq)
        k = self._split(self.k(memory), batch, seq)
        v = self._split(self.v(memory), batch, seq)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        probs = self.drop(F.softmax(scores + mask, dim=-1))
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return self.o(ctx.view(batch, seq, self.heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, act: nn.Module, dropout: float = 0.1) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act, self.drop = act, nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, batch: int, seq: int, act: nn.Module) -> None:
        super().__init__()
        self.batch, self.seq = batch, seq
        self.attn, self.ffn = Attention(dim, heads), FeedForward(dim, hidden, act)
        self.ln1, self.ln2, self.drop = LayerNorm(dim), LayerNorm(dim), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.drop(self.attn(x, x, mask, self.batch, self.seq)))
        return self.ln2(x + self.ffn(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, batch: int, seq: int) -> None:
        super().__init__()
        self.batch, self.seq = batch, seq
        self.self_attn, self.cross_attn = Attention(dim, heads), Attention(dim, heads)
        self.ffn = FeedForward(dim, hidden, nn.ReLU())
        self.ln1, self.ln2, self.ln3 = LayerNorm(dim), LayerNorm(dim), LayerNorm(dim)
        self.drop1, self.drop2 = nn.Dropout(0.1), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, causal: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.drop1(self.self_attn(x, x, causal, self.batch, self.seq)))
        x = self.ln2(x + self.drop2(self.cross_attn(x, memory, mask, self.batch, self.seq)))
        return self.ln3(x + self.ffn(x))


class BertLike(nn.Module):
    """BERT-large: 24 layers, hidden 1024, 16 heads; the mask feeds every layer."""

    def __init__(self, layers: int, dim: int, heads: int, vocab: int, batch: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos, self.seg = nn.Embedding(vocab, dim), nn.Embedding(seq, dim), nn.Embedding(2, dim)
        self.ln, self.drop = LayerNorm(dim), nn.Dropout(0.1)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, 4 * dim, batch, seq, Gelu())
                                    for _ in range(layers))
        self.pool, self.cls = nn.Linear(dim, dim), nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor, segments: torch.Tensor, positions: torch.Tensor,
                attn_mask: torch.Tensor) -> torch.Tensor:
        mask = (1.0 - attn_mask.unsqueeze(1).unsqueeze(2)) * -10000.0
        x = self.drop(self.ln(self.tok(tokens) + self.pos(positions) + self.seg(segments)))
        for layer in self.layers:
            x = layer(x, mask)
        return self.cls(torch.tanh(self.pool(x[:, 0])))


class EncoderDecoder(nn.Module):
    """Transformer-big-like: the encoder output and the masks feed every decoder layer."""

    def __init__(self, layers: int, dim: int, heads: int, vocab: int, batch: int, seq: int) -> None:
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(vocab, dim), nn.Embedding(vocab, dim)
        # sinusoidal table in the original: a constant here
        self.positions = nn.Parameter(torch.zeros(seq, dim))
        self.scale = math.sqrt(dim)
        self.src_drop, self.tgt_drop = nn.Dropout(0.1), nn.Dropout(0.1)
        self.encoder = nn.ModuleList(EncoderLayer(dim, heads, 4 * dim, batch, seq, nn.ReLU())
                                     for _ in range(layers))
        self.decoder = nn.ModuleList(DecoderLayer(dim, heads, 4 * dim, batch, seq) for _ in range(layers))
        self.out = nn.Linear(dim, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_mask: torch.Tensor,
                causal: torch.Tensor) -> torch.Tensor:
        x = self.src_drop(self.src_emb(src) * self.scale + self.positions)
        for layer in self.encoder:
            x = layer(x, src_mask)
        y = self.tgt_drop(self.tgt_emb(tgt) * self.scale + self.positions)
        for layer in self.decoder:
            y = layer(y, x, causal, src_mask)
        return F.log_softmax(self.out(y), dim=-1)


# --------------------------------------------------------------------- AmoebaNet parts
class ReluConvBn(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(F.relu(x)))


class SepConv(nn.Module):
    """Separable convolution, applied twice as in NASNet/AmoebaNet."""

    def __init__(self, channels: int, kernel: int, stride: int) -> None:
        super().__init__()
        pad = kernel // 2
        self.dw1 = nn.Conv2d(channels, channels, kernel, stride, pad, groups=channels, bias=False)
        self.pw1, self.bn1 = nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels)
        self.dw2 = nn.Conv2d(channels, channels, kernel, 1, pad, groups=channels, bias=False)
        self.pw2, self.bn2 = nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn1(self.pw1(self.dw1(F.relu(x))))
        return self.bn2(self.pw2(self.dw2(F.relu(x))))


class Conv1x7(nn.Module):
    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.a = nn.Conv2d(channels, channels, (1, 7), (1, stride), (0, 3), bias=False)
        self.b = nn.Conv2d(channels, channels, (7, 1), (stride, 1), (3, 0), bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.b(self.a(F.relu(x))))


def _cell_op(name: str, channels: int, stride: int) -> nn.Module:
    if name == "sep3":
        return SepConv(channels, 3, stride)
    if name == "sep5":
        return SepConv(channels, 5, stride)
    if name == "sep7":
        return SepConv(channels, 7, stride)
    if name == "avg":
        return nn.AvgPool2d(3, stride, 1, count_include_pad=False)
    if name == "max":
        return nn.MaxPool2d(3, stride, 1)
    if name == "conv17":
        return Conv1x7(channels, stride)
    if name == "id":
        return nn.Identity() if stride == 1 else ReluConvBn(channels, channels, 1, stride)
    raise ValueError(f"unknown cell op {name!r}")


# AmoebaNet-A genotype: (op, input) pairs, two per new hidden state; inputs 0/1 are the cell inputs.
_NORMAL = [("avg", 0), ("max", 0), ("sep3", 0), ("id", 0), ("id", 1), ("avg", 0),
           ("sep5", 2), ("sep3", 0), ("avg", 0), ("sep3", 1), ("sep7", 3), ("conv17", 2)]
_REDUCE = [("avg", 0), ("sep3", 0), ("max", 0), ("sep7", 2), ("max", 0), ("avg", 0),
           ("max", 0), ("sep3", 1), ("sep7", 1), ("avg", 4), ("conv17", 0), ("sep5", 3)]


class Cell(nn.Module):
    """A NASNet-style cell: two preprocessed inputs, pairwise ops summed into new states, concat."""

    def __init__(self, genotype: list[tuple[str, int]], c_prev_prev: int, c_prev: int, channels: int,
                 reduction: bool, reduction_prev: bool) -> None:
        super().__init__()
        self.pre0 = ReluConvBn(c_prev_prev, channels, 1, 2 if reduction_prev else 1)
        self.pre1 = ReluConvBn(c_prev, channels, 1)
        self.inputs = [i for _, i in genotype]
        self.ops = nn.ModuleList(_cell_op(op, channels, 2 if reduction and i < 2 else 1)
                                 for op, i in genotype)
        used = set(self.inputs)
        self.concat = [i for i in range(2, 2 + len(genotype) // 2) if i not in used]
        self.out_channels = channels * len(self.concat)

    def forward(self, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        states = [self.pre0(s0), self.pre1(s1)]
        for j in range(0, len(self.ops), 2):
            a = self.ops[j](states[self.inputs[j]])
            b = self.ops[j + 1](states[self.inputs[j + 1]])
            states.append(a + b)
        return torch.cat([states[i] for i in self.concat], dim=1)


class AmoebaNetLike(nn.Module):
    """AmoebaNet (N normal cells per stack, 3 stacks, 2 reduction cells): every cell reads the
    previous two cells' outputs, so each cell boundary carries a skip edge."""

    def __init__(self, normal_per_stack: int, channels: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, 2, 1, bias=False), nn.BatchNorm2d(channels))
        cells, c_pp, c_p, c, reduction_prev = [], channels, channels, channels, False
        for stack in range(3):
            if stack > 0:
                c *= 2
                cell = Cell(_REDUCE, c_pp, c_p, c, True, reduction_prev)
                cells.append(cell)
                c_pp, c_p, reduction_prev = c_p, cell.out_channels, True
            for _ in range(normal_per_stack):
                cell = Cell(_NORMAL, c_pp, c_p, c, False, reduction_prev)
                cells.append(cell)
                c_pp, c_p, reduction_prev = c_p, cell.out_channels, False
        self.cells = nn.ModuleList(cells)
        self.head = nn.Linear(c_p, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.head(F.adaptive_avg_pool2d(F.relu(s1), 1).flatten(1))


# --------------------------------------------------------------------- GNMT parts
class Recurrent(nn.Module):
    """One LSTM layer with dropout on its input and (optionally) a residual connection."""

    def __init__(self, cin: int, hidden: int, residual: bool, bidirectional: bool = False) -> None:
        super().__init__()
        self.lstm = nn.LSTM(cin, hidden, batch_first=True, bidirectional=bidirectional)
        self.drop, self.residual = nn.Dropout(0.2), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lstm(self.drop(x))[0]
        return out + x if self.residual else out


class BahdanauAttention(nn.Module):
    """GNMT's normalized Bahdanau attention over the encoder output."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query, self.key = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pq = self.query(q).unsqueeze(2)  # B, Tq, 1, H
        pk = self.key(keys).unsqueeze(1)  # B, 1, Tk, H
        v = self.v / self.v.norm()
        scores = (torch.tanh(pq + pk + self.bias) * v).sum(-1)
        probs = F.softmax(scores.masked_fill(mask, -65504.0), dim=-1)
        return torch.bmm(probs, keys)


class GnmtLike(nn.Module):
    """GNMT: a bidirectional first encoder layer, 8+8 LSTM layers with residuals from the third,
    attention context concatenated into every decoder layer."""

    def __init__(self, layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(vocab, hidden), nn.Embedding(vocab, hidden)
        self.enc_first = Recurrent(hidden, hidden // 2, residual=False, bidirectional=True)
        self.encoder = nn.ModuleList(Recurrent(hidden, hidden, residual=i >= 1) for i in range(layers - 1))
        self.dec_first = Recurrent(hidden, hidden, residual=False)
        self.attention = BahdanauAttention(hidden)
        self.decoder = nn.ModuleList(Recurrent(2 * hidden, hidden, residual=False) for _ in range(layers - 1))
        self.classifier = nn.Linear(hidden, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_pad: torch.Tensor) -> torch.Tensor:
        x = self.enc_first(self.src_emb(src))
        for layer in self.encoder:
            x = layer(x)
        y = self.dec_first(self.tgt_emb(tgt))
        ctx = self.attention(y, x, src_pad)
        for i, layer in enumerate(self.decoder):
            out = layer(torch.cat([y, ctx], dim=-1))
            y = out + y if i >= 1 else out
        return F.log_softmax(self.classifier(y), dim=-1)
