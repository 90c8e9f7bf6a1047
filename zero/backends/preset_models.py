"""A LLaMA-style module with a preset's params (`llama_like`), so that a simulation can run a real
forward and backward on a batch and measure activations, not only the params' memory.

Named and shaped as the preset (Hugging Face's LLaMA names: ``embed_tokens``, ``layers.N.self_attn.
{q,k,v,o}_proj``, ``layers.N.mlp.{gate,up,down}_proj``, the two RMSNorms a layer, ``norm``,
``lm_head``), heads of 128: the matmuls, attention (torch's ``scaled_dot_product_attention``,
causal), SwiGLU and norms a LLaMA layer runs, rotary embeddings aside (elementwise, one
temporary of the queries' and keys' size)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from zero.plans.meta import ParamMeta

__all__ = ["llama_like", "HEAD_DIM"]

HEAD_DIM = 128


class _Attention(nn.Module):
    def __init__(self, dim: int, kv_dim: int, dtype: torch.dtype):
        super().__init__()
        self.heads, self.kv_heads = dim // HEAD_DIM, kv_dim // HEAD_DIM
        self.q_proj = nn.Linear(dim, dim, bias=False, dtype=dtype)  # (registered in the presets' order)
        self.k_proj = nn.Linear(dim, kv_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(dim, kv_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(dim, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, HEAD_DIM).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj, self.up_proj = (nn.Linear(dim, hidden, bias=False, dtype=dtype) for _ in range(2))
        self.down_proj = nn.Linear(hidden, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, dim: int, kv_dim: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.self_attn, self.mlp = _Attention(dim, kv_dim, dtype), _Mlp(dim, hidden, dtype)
        self.input_layernorm, self.post_attention_layernorm = (nn.RMSNorm(dim, dtype=dtype) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, kv_dim: int, hidden: int, layers: int, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(dim, kv_dim, hidden, dtype) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, dtype=dtype)
        self.lm_head = nn.Linear(dim, vocab, bias=False, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def llama_like(metas: Sequence[ParamMeta]) -> nn.Module:
    """The LLaMA-style module whose params are ``metas`` (a preset's: the same names, shapes and
    dtype, in order); a ``ValueError`` when ``metas`` are not a LLaMA's."""
    shapes = {m.name: tuple(m.shape) for m in metas}
    try:
        vocab, dim = shapes["embed_tokens.weight"]
        kv_dim = shapes["layers.0.self_attn.k_proj.weight"][0]
        hidden = shapes["layers.0.mlp.gate_proj.weight"][0]
    except KeyError as e:
        raise ValueError(f"not a LLaMA preset (no {e.args[0]!r}): a batch runs through LLaMA-style presets or "
                         "a model of your own (--model)") from None
    layers = len({m.name.split(".")[1] for m in metas if m.name.startswith("layers.")})
    model = _Llama(vocab, dim, kv_dim, hidden, layers, getattr(torch, metas[0].dtype))
    got = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if got != [(m.name, tuple(m.shape)) for m in metas]:
        raise ValueError("the preset's params are not the LLaMA-style module's (names, shapes or order differ)")
    return model
