"""Shape lists of well-known models, built in code (no downloads), for planning and benchmarks."""

from __future__ import annotations

from zero.plans.meta import ParamMeta

__all__ = ["PRESETS", "preset", "llama"]


def gpt2() -> list[ParamMeta]:
    """GPT-2 small (124M, 148 tensors; the LM head is tied to ``wte``)."""
    d, vocab, ctx = 768, 50257, 1024
    shapes = {"wte.weight": (vocab, d), "wpe.weight": (ctx, d)}
    for i in range(12):
        p = f"h.{i}."
        shapes |= {p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
                   p + "attn.c_attn.weight": (d, 3 * d), p + "attn.c_attn.bias": (3 * d,),
                   p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
                   p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
                   p + "mlp.c_fc.weight": (d, 4 * d), p + "mlp.c_fc.bias": (4 * d,),
                   p + "mlp.c_proj.weight": (4 * d, d), p + "mlp.c_proj.bias": (d,)}
    shapes |= {"ln_f.weight": (d,), "ln_f.bias": (d,)}
    return [ParamMeta(n, s) for n, s in shapes.items()]


def llama(d: int, ff: int, layers: int, kv: int, vocab: int = 32000, dtype: str = "bfloat16") -> list[ParamMeta]:
    """A LLaMA in ``dtype``: ``layers`` blocks of width ``d`` with ``ff``-wide MLPs and key/value
    projections ``kv`` wide (grouped-query attention when ``kv < d``); the presets' and, small,
    the simulations' tests' (`zero.backends.preset_models` runs it)."""
    shapes = {"embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d)}
        shapes |= {p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                   p + "mlp.down_proj.weight": (d, ff),
                   p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
    shapes |= {"norm.weight": (d,), "lm_head.weight": (vocab, d)}
    return [ParamMeta(n, s, dtype) for n, s in shapes.items()]


def llama_7b() -> list[ParamMeta]:
    """LLaMA-7B in bfloat16 (291 tensors, 6.7B parameters)."""
    return llama(4096, 11008, 32, 4096)


def llama_70b() -> list[ParamMeta]:
    """LLaMA-2-70B in bfloat16 (723 tensors, 69.0B parameters; 8 key/value heads of 128)."""
    return llama(8192, 28672, 80, 1024)


def moe_100k() -> list[ParamMeta]:
    """A mixture-of-experts model with ~100k tensors: 64 layers x 512 small experts."""
    d, hidden, experts, layers = 1024, 256, 512, 64
    metas = [ParamMeta("embed.weight", (32000, d))]
    for i in range(layers):
        p = f"layers.{i}."
        metas += [ParamMeta(p + f"attn.{x}.weight", (d, d)) for x in ("q", "k", "v", "o")]
        metas += [ParamMeta(p + "norm1.weight", (d,)), ParamMeta(p + "norm2.weight", (d,)),
                  ParamMeta(p + "router.weight", (experts, d))]
        for e in range(experts):
            q = f"{p}experts.{e}."
            metas += [ParamMeta(q + "w1", (hidden, d)), ParamMeta(q + "w2", (d, hidden)),
                      ParamMeta(q + "w3", (hidden, d))]
    return metas + [ParamMeta("norm.weight", (d,)), ParamMeta("lm_head.weight", (32000, d))]


PRESETS = {"gpt2": gpt2, "llama-7b": llama_7b, "llama-70b": llama_70b, "moe-100k": moe_100k}


def preset(name: str) -> list[ParamMeta]:
    """The parameter metadata of a well-known model, by name (one of ``PRESETS``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
