"""`GPTConfig` and the presets: every shape of the GPT, validated, with its parameter count.

The presets: "tiny" for tests, "small" for the CPU demo, and "gpt2-124m" / "llama-1b"
shapes for FLOP and memory arithmetic only (never instantiated in tests).
"""

from __future__ import annotations

import dataclasses


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Every shape of the GPT, validated at construction; derive variants with `with_`."""

    vocab_size: int = 256
    max_seq_len: int = 128  # RoPE tables are built for this length; longer inputs raise ValueError
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None  # None -> n_head (plain multi-head); fewer -> grouped-query attention
    d_model: int = 64
    ffn_hidden: int | None = None  # None -> Llama rule: 8*d_model/3 rounded up to a multiple_of
    multiple_of: int = 16
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False  # the LM head shares the token-embedding matrix
    # GPT-2 style biases on wq, wk, wv, wo and the dense MLP's w_gate, w_up, w_down (zero at init;
    # norms, the head and MoE experts have none). Off: Llama's bias-free linears.
    bias: bool = False
    dropout: float = 0.0  # on attention probabilities and on both residual branches
    # How masks are drawn: "stream" from torch's generator (F.dropout; tensor parallelism then
    # needs parallel.tensor_dropout, and pipeline and context parallelism refuse it), or "counter"
    # hashed from each element's global coordinates: the same in every layout (models/dropout.py).
    dropout_masks: str = "stream"
    dropout_seed: int = 0  # counter masks' seed: part of the config, not of the weights' init seed
    attn_impl: str = "sdpa"  # "sdpa" (fused kernel) or "math" (explicit matmuls: FLOP counters see them)
    init_std: float = 0.02
    # Mixture of experts (tinyscale.moe; lessons/13-moe.md). 0 experts: every block's MLP is dense.
    moe_experts: int = 0  # E routed SwiGLU experts in each MoE block
    moe_top_k: int = 2  # experts per token
    moe_capacity_factor: float | None = None  # None: no limit; else ceil(cf * tokens * k / E) per expert
    moe_layers: tuple[int, ...] | None = None  # block indices that are MoE; None: every block
    moe_shared_experts: int = 0  # experts every token also goes through (DeepSeek-MoE), fused in one SwiGLU
    moe_ffn_hidden: int | None = None  # one expert's hidden width; None: ffn_dim
    moe_router: str = "softmax"  # "softmax" (Switch, GShard, Mixtral) or "sigmoid" (DeepSeek-V3)
    moe_aux_loss_coef: float = 0.01  # alpha of the Switch load-balancing loss
    moe_z_loss_coef: float = 0.001  # beta of the router z-loss (ST-MoE)

    def __post_init__(self) -> None:
        def require(ok: bool, field: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"GPTConfig.{field}={getattr(self, field)!r} is invalid: {fix}")

        for field in ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model", "multiple_of"):
            require(_positive_int(getattr(self, field)), field, "it must be a positive int")
        for field in ("n_kv_head", "ffn_hidden"):
            value = getattr(self, field)
            require(value is None or _positive_int(value), field, "it must be None or a positive int")
        require(self.d_model % self.n_head == 0, "d_model",
                f"it must be a multiple of n_head={self.n_head} (head_dim = d_model // n_head)")
        require(self.n_head % self.kv_heads == 0, "n_kv_head", f"it must divide n_head={self.n_head} "
                "(each K/V head serves a group of query heads): pick a divisor of n_head, or None")
        require(self.head_dim % 2 == 0, "d_model", f"head_dim = d_model // n_head = {self.head_dim} "
                "must be even (RoPE rotates pairs of dimensions): change d_model or n_head")
        for field in ("norm_eps", "rope_theta", "init_std"):
            require(getattr(self, field) > 0, field, "it must be > 0")
        require(0.0 <= self.dropout < 1.0, "dropout", "it must satisfy 0 <= dropout < 1")
        require(self.attn_impl in ("sdpa", "math"), "attn_impl", "use 'sdpa' or 'math'")
        require(isinstance(self.bias, bool), "bias", "it must be True or False")
        require(self.dropout_masks in ("stream", "counter"), "dropout_masks", "use 'stream' or 'counter'")
        require(isinstance(self.dropout_seed, int) and not isinstance(self.dropout_seed, bool), "dropout_seed",
                "it must be an int")
        self._check_moe(require)

    def _check_moe(self, require) -> None:
        require(isinstance(self.moe_experts, int) and self.moe_experts >= 0, "moe_experts",
                "it must be an int >= 0 (0: a dense model)")
        for field in ("moe_shared_experts",):
            require(isinstance(getattr(self, field), int) and getattr(self, field) >= 0, field, "it must be an int >= 0")
        require(self.moe_ffn_hidden is None or _positive_int(self.moe_ffn_hidden), "moe_ffn_hidden",
                "it must be None or a positive int")
        if not self.moe_experts:
            return
        require(_positive_int(self.moe_top_k) and self.moe_top_k <= self.moe_experts, "moe_top_k",
                f"it must be between 1 and moe_experts={self.moe_experts}")
        require(self.moe_capacity_factor is None or self.moe_capacity_factor > 0, "moe_capacity_factor",
                "it must be None (no limit) or > 0")
        require(self.moe_router in ("softmax", "sigmoid"), "moe_router", "use 'softmax' or 'sigmoid'")
        require(self.moe_layers is None or (isinstance(self.moe_layers, tuple) and
                all(isinstance(i, int) and 0 <= i < self.n_layer for i in self.moe_layers)), "moe_layers",
                f"it must be None (every block) or a tuple of block indices in 0..{self.n_layer - 1}")
        for field in ("moe_aux_loss_coef", "moe_z_loss_coef"):
            require(getattr(self, field) >= 0, field, "it must be >= 0")

    def is_moe_layer(self, index: int) -> bool:
        """Block `index` has an MoE feed-forward (else the dense SwiGLU)."""
        return self.moe_experts > 0 and (self.moe_layers is None or index in self.moe_layers)

    @property
    def expert_dim(self) -> int:  # one expert's hidden width
        return self.ffn_dim if self.moe_ffn_hidden is None else self.moe_ffn_hidden

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:  # n_kv_head resolved
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def kv_dim(self) -> int:  # output width of wk and wv
        return self.kv_heads * self.head_dim

    @property
    def ffn_dim(self) -> int:
        """ffn_hidden resolved. Llama's 8C/3 makes 3 matrices of C x 8C/3 as big as 2 of C x 4C."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return -(-int(8 * self.d_model / 3) // self.multiple_of) * self.multiple_of  # ceil to multiple

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count from the shapes alone, without building the model (tied head counted once).
        include_embedding=False leaves out the token-embedding table (a lookup, no FLOPs); an
        untied head stays (a matmul), a tied one goes with the table it is."""
        C, V = self.d_model, self.vocab_size
        attn = 2 * C * C + 2 * C * self.kv_dim  # wq, wo: C x C; wk, wv: C x K*D
        mlp = 3 * C * self.ffn_dim  # w_gate, w_up: C x F; w_down: F x C
        attn, mlp = attn + self.attn_bias_params, mlp + self.mlp_bias_params
        total = self.n_layer * (attn + mlp + 2 * C) + C  # two RMSNorms per block, one final
        moe = self.moe_experts * C + 3 * C * self.expert_dim * (self.moe_experts + self.moe_shared_experts)
        total += sum(moe - mlp for i in range(self.n_layer) if self.is_moe_layer(i))  # router + experts
        total += 0 if self.tie_embeddings else V * C  # untied LM head
        return total + (V * C if include_embedding else 0)

    @property
    def attn_bias_params(self) -> int:  # wq, wk, wv, wo biases: C + 2 K*D + C (0 without bias)
        return (2 * self.d_model + 2 * self.kv_dim) if self.bias else 0

    @property
    def mlp_bias_params(self) -> int:  # a dense MLP's w_gate, w_up, w_down biases: 2F + C (MoE experts: none)
        return (2 * self.ffn_dim + self.d_model) if self.bias else 0

    def with_(self, **changes) -> GPTConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> GPTConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}: choose one of {sorted(PRESETS)}")
        return PRESETS[name]


PRESETS: dict[str, GPTConfig] = {
    # For tests: every feature (GQA, RoPE, SwiGLU) at a size that runs in milliseconds. 41,120 params.
    "tiny": GPTConfig(vocab_size=256, max_seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32),
    # CPU demo on the byte-level corpus: 869,504 params.
    "small": GPTConfig(vocab_size=256, max_seq_len=128, n_layer=4, n_head=4, d_model=128),
    # GPT-2 small's shapes, for FLOP/memory arithmetic. ffn_hidden=2048 gives the SwiGLU MLP's
    # three C x 2048 matrices exactly the parameters of GPT-2's two C x 4C ones. Without GPT-2's
    # learned positions and biases: 123,551,232 params (GPT-2 itself: 124,439,808).
    "gpt2-124m": GPTConfig(vocab_size=50257, max_seq_len=1024, n_layer=12, n_head=12, d_model=768,
                           ffn_hidden=2048, tie_embeddings=True),
    # Llama-3.2-1B's shapes (its long-context RoPE scaling is not modelled): 1,235,814,400 params.
    "llama-1b": GPTConfig(vocab_size=128256, max_seq_len=8192, n_layer=16, n_head=32, n_kv_head=8,
                          d_model=2048, ffn_hidden=8192, rope_theta=500000.0, tie_embeddings=True),
}
