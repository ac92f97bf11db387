"""The models a plan can be for: tinyscale's GPT presets plus published shapes, or sizes given.

Every model is a `GPTConfig` (Llama-style block: RMSNorm, GQA, SwiGLU), so FLOPs
(`tinyscale.mfu`) and exact model states (`engine.layout_memory`) apply. A GPT-3-style model's
4h GeLU MLP (2 matrices of h x 4h) is written as a SwiGLU of width 8h/3 (3 matrices), the same
parameters and FLOPs; its learned positions and biases are left out.

    llama2-7b / 13b / 70b   Llama 2 (Touvron et al. 2023b) states parameters, 4,096 context, GQA
                            for 34B and 70B only (table 1) and the 32k vocabulary, not the shapes;
                            it keeps Llama 1's architecture (sec. 2.2), whose paper (Touvron et al.
                            2023a, table 2) gives layers/width/heads: 32/4096/32, 40/5120/40 and, for
                            its 65B, 80/8192/64. The MLP widths (11008, 13824, 28672) and the 70B's
                            8 K/V heads are from Meta's released configs (params.json;
                            num_key_value_heads in meta-llama/Llama-2-70b-hf's config.json)
    gpt3-175b               Brown et al. 2020, table 2.1 (96 layers, h 12288, 96 heads)
    megatron-1t             Narayanan et al. 2021, table 1 (128 layers, h 25600, 160 heads)
    mixtral-8x7b            Jiang et al. 2024 ("Mixtral of Experts"), table 1: 32 layers, width 4096,
                            32 heads with 8 K/V heads, expert width 14336, 8 experts per block of
                            which each token uses 2, vocabulary 32000, 32k context; every block MoE,
                            no shared experts: 46.7B parameters, 12.9B used per token
    custom sizes            "layers=80,d_model=8192,heads=64,kv_heads=8,ffn=28672,vocab=32000"
                            (an MoE GPT: add experts=8,top_k=2)
"""

from __future__ import annotations

from tinyscale.models.config import PRESETS, GPTConfig

PLANNER_PRESETS: dict[str, GPTConfig] = {
    "gpt2-124m": PRESETS["gpt2-124m"],
    "llama-1b": PRESETS["llama-1b"],
    "llama2-7b": GPTConfig(vocab_size=32000, max_seq_len=4096, n_layer=32, n_head=32, d_model=4096,
                           ffn_hidden=11008),
    "llama2-13b": GPTConfig(vocab_size=32000, max_seq_len=4096, n_layer=40, n_head=40, d_model=5120,
                            ffn_hidden=13824),
    "llama2-70b": GPTConfig(vocab_size=32000, max_seq_len=4096, n_layer=80, n_head=64, n_kv_head=8,
                            d_model=8192, ffn_hidden=28672),
    "gpt3-175b": GPTConfig(vocab_size=51200, max_seq_len=2048, n_layer=96, n_head=96, d_model=12288,
                           ffn_hidden=32768),
    "megatron-1t": GPTConfig(vocab_size=51200, max_seq_len=2048, n_layer=128, n_head=160, d_model=25600,
                             ffn_hidden=68266),
    "mixtral-8x7b": GPTConfig(vocab_size=32000, max_seq_len=32768, n_layer=32, n_head=32, n_kv_head=8, d_model=4096,
                              ffn_hidden=14336, moe_experts=8, moe_top_k=2),
}
_KEYS = {"layers": "n_layer", "d_model": "d_model", "heads": "n_head", "kv_heads": "n_kv_head",
         "ffn": "ffn_hidden", "vocab": "vocab_size", "tied": "tie_embeddings", "experts": "moe_experts",
         "top_k": "moe_top_k"}


def resolve_model(spec: str | GPTConfig) -> GPTConfig:
    """A preset's name, "key=value,..." sizes (keys: layers, d_model, heads, kv_heads, ffn, vocab,
    tied, experts, top_k), or a GPTConfig as is."""
    if isinstance(spec, GPTConfig):
        return spec
    if spec in PLANNER_PRESETS:
        return PLANNER_PRESETS[spec]
    if "=" not in spec:
        raise ValueError(f"--model {spec!r}: use a preset ({', '.join(PLANNER_PRESETS)}) or sizes like "
                         "layers=32,d_model=4096,heads=32,ffn=11008,vocab=32000")
    fields: dict = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in _KEYS:
            raise ValueError(f"--model: unknown size {key!r}: use {', '.join(_KEYS)}")
        name = _KEYS[key.strip()]
        fields[name] = value.strip().lower() in ("1", "true", "yes") if name == "tie_embeddings" else int(value)
    missing = [k for k in ("layers", "d_model", "heads", "vocab") if _KEYS[k] not in fields]
    if missing:
        raise ValueError(f"--model {spec!r}: give {', '.join(missing)} too")
    return GPTConfig(max_seq_len=1, **fields)
