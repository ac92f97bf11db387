"""Exact matmul FLOPs of the GPT's training step, from its config, and the usual shortcuts.

Every FLOP the GPT spends in a matrix multiply, counted from `GPTConfig` alone. A multiply of
an (m, k) by a (k, n) matrix costs 2mkn FLOPs (one multiply and one add per term), the
convention of `torch.utils.flop_counter.FlopCounterMode`, with which these counts agree exactly
(tests/mfu/test_flops.py). Elementwise work (RMSNorm, RoPE, SiLU, softmax, the loss, the
optimizer) is left out, as every MFU convention does: it is small and runs at memory speed.

Per layer, one forward pass over one sequence of T tokens (shape legend of models/gpt.py:
C d_model, H query heads, K key/value heads, D = C / H, F ffn hidden, V vocab):

    wq, wo        2 x 2TC^2                       (C -> H*D = C and back)
    wk, wv        2 x 2TC(KD)                     (C -> K*D: GQA shrinks only these two)
    Q K^T         2 T^2 H D = 2 T^2 C             (every query against every key, all H heads)
    P V           2 T^2 C
    SwiGLU        3 x 2TCF                        (w_gate, w_up, w_down)
    LM head       2TCV  (once, after the last layer; tied or not, the matmul is the same)

Backward is exactly twice the forward: each matmul Y = XW needs dX = dY W^T and dW = X^T dY,
each as large as the forward product (the GPT's every matmul input needs a gradient: the
embedding is trainable). The token-embedding lookup is an index, not a matmul: 0 FLOPs.

Attention is counted over the full T x T square, because that is what the explicit ("math")
attention computes (it masks after multiplying) and what PaLM's formula assumes. A causal
kernel (flash attention) skips the masked half: pass causal=True to count only the
T(T+1)/2 query-key pairs it needs. A fused attention kernel's backward (flash attention's,
SDPA's) does not keep P: it recomputes Q K^T from the saved log-sum-exp, one more 2T^2C per
layer (`ForwardFlops.backward_rerun`): hardware FLOPs, not model FLOPs (torch's
FlopCounterMode counts SDPA's backward so: 5 matmuls to the forward's 2).

Layouts (`layout_flops`): summed over the ranks of a tensor-parallel group the matmuls are the
model's, except the LM head's padded vocabulary rows (the vocab is padded to a multiple of tp:
the head runs Vp = ceil(V/tp) tp rows); under context parallelism each sequence is padded to
a multiple of the chunk count (every padded position runs every matmul), ring attention runs
the blocks of `context_parallel.block_plan` (a whole block for each, the diagonal's masked
half included: the same convention as the full square above; blocks wholly in the future are
skipped) and recomputes each block's Q K^T in its backward, and Ulysses runs each rank's H/cp
heads over the whole padded sequence (a fused kernel, or merge.py's block differentiated by
autograd under dropout, which keeps P).

With N_matmul = the weights used in matmuls (all Linear weights, the LM head included, tied or
not), the model FLOPs per token are exactly PaLM's 6 N_matmul + 12 L H Q T (Chowdhery et al.,
"PaLM", 2022, appendix B; Q = D, T the sequence length). The shortcuts go wrong only in which N
they plug in and whether they count attention; `approximations` computes them side by side.

What recomputation reruns (`ForwardFlops.recomputed`) depends on the checkpoint. Without early
stop (re-entrant, early_stop=False, Megatron's count) every matmul of each region. With it (the
non-re-entrant default, ours and torch's; and a checkpoint in a block compiled with "aot_eager",
whose backward graph reruns the same matmuls) the rerun ends at the region's last
saved tensor, so a last matmul whose output nothing saves is not rerun: the block's MLP down
projection, unless a residual dropout after it saves a mask drawn from its output; the core's
P v, unless a fused SDPA kernel saves its own output. Whether the core is a fused kernel is the
config's (attn_impl "math", or counter dropout masks, run it as matmuls) unless the layout
decides otherwise: tensor parallelism with dropout runs it as matmuls whatever attn_impl says
(its dropout, drawn per rank, is passed in as a function SDPA cannot take), so the engine passes
explicit_core=True there (engine/throughput.py).

Lesson: lessons/06-mfu.md. Tests: `pytest tests/mfu -k mfu`.
"""

from __future__ import annotations

import dataclasses

from tinyscale.models import GPTConfig

RECOMPUTE = ("none", "selective", "full")


def _check(config: GPTConfig, seq_len: int) -> None:
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a tinyscale.models.GPTConfig, got {type(config).__name__}: "
                         "build one with GPTConfig(...) or GPTConfig.preset(name)")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} is invalid: it must be a positive int (tokens per sequence)")


# --8<-- [start:forward-flops]
@dataclasses.dataclass(frozen=True)
class ForwardFlops:
    """Matmul FLOPs of one forward pass over one sequence of `seq_len` tokens, by part.

    Every field sums over all layers. `backward` is 2x `forward`; `model` (forward + backward)
    is what MFU counts; `hardware(recompute)` adds what activation recomputation re-runs and a
    fused attention backward recomputes (HFU). From `layout_flops`, the fields are what a
    layout's ranks run together (padding included), and `model` is no longer the model's.
    """

    seq_len: int
    n_layer: int
    qkvo: int  # wq, wk, wv, wo
    scores: int  # Q K^T
    values: int  # P V
    mlp: int  # w_gate, w_up, w_down
    head: int  # LM head
    # The FFN's last matmul, whose output no saved tensor comes from (w_down; an MoE block's shared
    # experts' w_down, or 0 without shared experts: the combine saves the routed experts' outputs).
    mlp_last: int = 0
    residual_dropout: bool = False  # dropout after w_down saves a mask drawn from its output: a rerun reaches it
    explicit_core: bool = True  # P v is a matmul of its own (attn_impl "math" or counter masks), not SDPA's
    # Q K^T that the attention core's own backward recomputes (a fused kernel's, or ring attention's
    # blocks'): from the saved log-sum-exp, as flash attention does. Hardware FLOPs only.
    backward_rerun: int = 0

    @property
    def attention(self) -> int:
        """Q K^T and P V: the only part that grows with T per token."""
        return self.scores + self.values

    @property
    def forward(self) -> int:
        return self.qkvo + self.attention + self.mlp + self.head

    @property
    def backward(self) -> int:
        return 2 * self.forward  # dX = dY W^T and dW = X^T dY, each the size of Y = X W

    @property
    def model(self) -> int:
        """Model FLOPs of one training step on this sequence: what MFU counts."""
        return self.forward + self.backward

    def recomputed(self, recompute: str = "none", recomputed_layers: int | None = None,
                   early_stop: bool = True) -> int:
        """Forward FLOPs that activation checkpointing runs a second time, during backward.

        "full" re-runs whole blocks (all of them, or the first `recomputed_layers`: the count
        is what matters, not which), "selective" only the attention core (Q K^T, softmax, P V;
        Korthikanti et al. 2022, sec. 4). The LM head is never recomputed.

        early_stop=True (tinyscale's and torch's non-re-entrant default, and a compiled block's
        checkpoint): a region's last matmul is left out when nothing saves its output (w_down
        without residual dropout, P V when it is a matmul of its own). early_stop=False counts
        every matmul of the region, as re-entrant checkpointing and Megatron do. Both measured
        with FlopCounterMode per policy (tests/mfu/test_flops.py)."""
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute={recompute!r} is unknown: choose one of {', '.join(RECOMPUTE)}")
        if not isinstance(early_stop, bool):
            raise ValueError(f"early_stop={early_stop!r}: pass True (non-re-entrant checkpoint, or compiled) "
                             "or False (re-entrant, or early_stop=False)")
        layers = self.n_layer if recomputed_layers is None else recomputed_layers
        if not isinstance(layers, int) or isinstance(layers, bool) or not 0 <= layers <= self.n_layer:
            raise ValueError(f"recomputed_layers={recomputed_layers!r} is invalid: it must be an int "
                             f"in 0..n_layer={self.n_layer}, or None for every layer")
        if recompute == "none":
            return 0
        if recompute == "selective":
            per_layer = self.attention - (self.values if early_stop and self.explicit_core else 0)
        else:
            unsaved = self.mlp_last if early_stop and not self.residual_dropout else 0
            per_layer = self.qkvo + self.attention + self.mlp - unsaved
        return per_layer // self.n_layer * layers

    def hardware(self, recompute: str = "none", recomputed_layers: int | None = None,
                 early_stop: bool = True) -> int:
        """FLOPs the hardware executes in one step: model FLOPs plus recomputation (HFU), that of
        the checkpoint (`recomputed`) and that of a fused attention backward (`backward_rerun`)."""
        return self.model + self.recomputed(recompute, recomputed_layers, early_stop) + self.backward_rerun


def forward_flops(config: GPTConfig, seq_len: int, *, causal: bool = False,
                  explicit_core: bool | None = None) -> ForwardFlops:
    """Exact matmul FLOPs of the GPT's forward pass over one sequence of `seq_len` tokens.

    `seq_len` may exceed config.max_seq_len (this is arithmetic: the model itself would refuse).
    causal=False counts the full T x T attention square (the math path, PaLM's convention);
    causal=True only the T(T+1)/2 pairs a causal kernel must compute. explicit_core: whether
    the attention core runs as matmuls of its own (what an early stop can skip P v of); None
    reads it from the config, True where the layout makes it so (tensor parallelism with
    dropout). It changes only the hardware count (`recomputed`, `backward_rerun`), not the model FLOPs."""
    _check(config, seq_len)
    if explicit_core is None:
        explicit_core = config.attn_impl == "math" or (config.dropout > 0 and config.dropout_masks == "counter")
    elif not isinstance(explicit_core, bool):
        raise ValueError(f"explicit_core={explicit_core!r}: pass True (the core's matmuls run on their own), "
                         "False (a fused SDPA kernel) or None (from the config)")
    T, C, L = seq_len, config.d_model, config.n_layer
    pairs = T * (T + 1) // 2 if causal else T * T  # query-key pairs per head
    scores = L * 2 * pairs * C  # per head (T, D) @ (D, T): 2 T^2 D; H heads: H D = C
    return ForwardFlops(
        seq_len=T,
        n_layer=L,
        qkvo=L * 2 * T * C * (2 * C + 2 * config.kv_dim),  # (T, C) @ (C, C | K*D), four of them
        scores=scores,
        values=L * 2 * pairs * C,  # per head (T, T) @ (T, D)
        mlp=T * mlp_flops_per_token(config),  # dense: (T, C) @ (C, F) twice, (T, F) @ (F, C) once
        head=2 * T * C * config.vocab_size,  # (T, C) @ (C, V)
        mlp_last=T * sum(2 * C * (config.moe_shared_experts * config.expert_dim if config.is_moe_layer(i)
                                  else config.ffn_dim) for i in range(L)),  # (T, F) @ (F, C)
        residual_dropout=config.dropout > 0,
        explicit_core=explicit_core,
        backward_rerun=0 if explicit_core else scores,  # a fused kernel's backward recomputes Q K^T
    )
# --8<-- [end:forward-flops]


CP_ALGORITHMS = ("ring", "ulysses")
CP_SHARDINGS = ("zigzag", "contiguous")  # context_parallel.SHARDINGS: 2 cp chunks or cp


def _degree(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: it must be a positive int (the layout's degree)")


# --8<-- [start:layout-flops]
def layout_flops(config: GPTConfig, seq_len: int, *, tp: int = 1, cp: int = 1, cp_algorithm: str = "ring",
                 cp_sharding: str = "zigzag", causal: bool = False,
                 explicit_core: bool | None = None) -> ForwardFlops:
    """The matmul FLOPs one sequence of `seq_len` tokens costs on a tp x cp layout, summed over
    its ranks: what the hardware runs (HFU's count; MFU keeps `forward_flops`, the model's).

    tp: the LM head runs the padded vocabulary, Vp = ceil(V / tp) tp rows. cp: every matmul runs
    on the padded length P, a multiple of the chunk count N (2 cp zigzag, cp contiguous:
    `context_parallel.Layout`); attention as `cp_algorithm` runs it. Ring: the blocks of
    `context_parallel.block_plan`, whichever rank holds which chunk, are every pair of chunks
    (query chunk, key chunk) but those wholly in the future, each its whole L x L rectangle
    (causal=True: a diagonal block's lower triangle only), and its backward recomputes every
    block's Q K^T (tests/mfu check the sum against the plan and against FlopCounterMode).
    Ulysses: the H heads over P x P (causal=True: the triangle), its backward recomputing Q K^T
    unless dropout runs merge.py's block under autograd, which keeps P. Under cp the algorithm
    decides `explicit_core` too: ring attention saves its output (a rerun runs it whole), and
    so does Ulysses' fused kernel; under dropout nothing saves Ulysses' P v (an early stop
    skips it). `explicit_core` is read only at cp = 1 (`forward_flops`). Every block of the plan
    is counted, as the Triton kernel runs it; the CPU's flash path skips a block whose keys are
    all padding, which happens only when a whole chunk is padding (seq_len <= P - P / chunks)."""
    _degree("tp", tp)
    _degree("cp", cp)
    if cp_algorithm not in CP_ALGORITHMS:
        raise ValueError(f"cp_algorithm={cp_algorithm!r} is unknown: use one of {CP_ALGORITHMS}")
    if cp_sharding not in CP_SHARDINGS:
        raise ValueError(f"cp_sharding={cp_sharding!r} is unknown: use one of {CP_SHARDINGS}")
    vocab = -(-config.vocab_size // tp) * tp  # tensor_parallel.padded_size: Megatron's padded vocab
    if cp == 1:
        flops = forward_flops(config, seq_len, causal=causal, explicit_core=explicit_core)
        return dataclasses.replace(flops, head=2 * seq_len * config.d_model * vocab)
    _check(config, seq_len)
    N = 2 * cp if cp_sharding == "zigzag" else cp  # chunks
    L = -(-seq_len // N)  # a chunk's length
    P, C = N * L, config.d_model
    if cp_algorithm == "ulysses":
        pairs = P * (P + 1) // 2 if causal else P * P  # per head, every head once over the cp ranks
    else:  # N (N - 1) / 2 chunk pairs in the past, N on the diagonal
        pairs = N * (N - 1) // 2 * L * L + N * (L * (L + 1) // 2 if causal else L * L)
    dropout = config.dropout > 0  # counter masks: cp refuses stream masks
    explicit = cp_algorithm == "ulysses" and dropout
    scores = config.n_layer * 2 * pairs * C  # Q K^T; P V alike
    padded = forward_flops(config, P, explicit_core=explicit)  # every matmul on the padded length
    return dataclasses.replace(padded, seq_len=seq_len, scores=scores, values=scores, head=2 * P * C * vocab,
                               backward_rerun=0 if explicit else scores)
# --8<-- [end:layout-flops]


def mlp_flops_per_token(config: GPTConfig) -> int:
    """Forward matmul FLOPs of every block's feed-forward for one token. A dense block: 3 matmuls
    of C x F. An MoE block (tinyscale.moe) runs only the k experts the token is routed to (and the
    shared ones) plus the router: 2 C E + 6 C F_e (k + shared), whatever the expert count E;
    dropped assignments would do less (this counts none dropped)."""
    C, total = config.d_model, 0
    for i in range(config.n_layer):
        if config.is_moe_layer(i):
            total += 2 * C * config.moe_experts + 6 * C * config.expert_dim * (config.moe_top_k +
                                                                              config.moe_shared_experts)
        else:
            total += 6 * C * config.ffn_dim
    return total


def model_flops_per_token(config: GPTConfig, seq_len: int, *, causal: bool = False) -> float:
    """Forward + backward matmul FLOPs per token: the numerator of MFU (per token processed)."""
    return forward_flops(config, seq_len, causal=causal).model / seq_len


def hardware_flops_per_token(config: GPTConfig, seq_len: int, *, recompute: str = "none",
                             recomputed_layers: int | None = None, causal: bool = False,
                             early_stop: bool = True, explicit_core: bool | None = None, tp: int = 1,
                             cp: int = 1, cp_algorithm: str = "ring", cp_sharding: str = "zigzag") -> float:
    """Executed matmul FLOPs per (real) token, recomputation included: the numerator of HFU.
    early_stop: as `ForwardFlops.recomputed` (False for a re-entrant checkpoint); explicit_core:
    as `forward_flops`; tp, cp, cp_algorithm, cp_sharding: the layout (`layout_flops`)."""
    flops = layout_flops(config, seq_len, tp=tp, cp=cp, cp_algorithm=cp_algorithm, cp_sharding=cp_sharding,
                         causal=causal, explicit_core=explicit_core)
    return flops.hardware(recompute, recomputed_layers, early_stop) / seq_len


def matmul_params(config: GPTConfig) -> int:
    """Weights that take part in a matmul: every Linear weight, the LM head included even when
    tied (the tied matrix is multiplied once as the head). Not the embedding lookup or norms."""
    C = config.d_model
    per_layer = 2 * C * C + 2 * C * config.kv_dim + 3 * C * config.ffn_dim
    return config.n_layer * per_layer + config.vocab_size * C


# --8<-- [start:approximations]
def approximations(config: GPTConfig, seq_len: int) -> dict[str, float]:
    """Model FLOPs per token by the exact count and by the shortcuts people use, side by side.

    - "exact": `model_flops_per_token` (full attention square).
    - "6N (all params)": 6 x every parameter. Counts the embedding table as if it were a
      matmul (it is a lookup) and leaves out attention.
    - "6N (non-embedding)": Kaplan et al. (2020)'s N without the embedding table. Leaves out
      attention, and the LM head too when it is tied to the embedding.
    - "6N + 12LHQT (non-embedding N)": PaLM's formula with the N most code plugs in
      (nanoGPT, torchtitan): exact up to the norm weights when the head is untied; misses the
      head's 6VC when it is tied (nanoGPT keeps the tied matrix in N for that reason).
    - "6N + 12LHQT (matmul N)": PaLM with N = `matmul_params`: equal to "exact".
    """
    L, H, Q, T = config.n_layer, config.n_head, config.head_dim, seq_len
    attention = 12 * L * H * Q * T
    return {
        "exact": model_flops_per_token(config, seq_len),
        "6N (all params)": 6.0 * config.num_params(include_embedding=True),
        "6N (non-embedding)": 6.0 * config.num_params(include_embedding=False),
        "6N + 12LHQT (non-embedding N)": 6.0 * config.num_params(include_embedding=False) + attention,
        "6N + 12LHQT (matmul N)": 6.0 * matmul_params(config) + attention,
    }
# --8<-- [end:approximations]


def attention_share(config: GPTConfig, seq_len: int, *, causal: bool = False) -> float:
    """Fraction of the model FLOPs spent in Q K^T and P V: 12LCT / (6 N_matmul + 12LCT)."""
    f = forward_flops(config, seq_len, causal=causal)
    return f.attention / f.forward
