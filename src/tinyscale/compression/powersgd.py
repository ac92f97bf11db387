"""PowerSGD (Vogels et al. 2019): rank-r gradient compression by one step of power iteration.

For each gradient matrix M (n x m; a conv or higher-order tensor is viewed as n x rest):

    M += e                      # error feedback: last step's residual
    P = M Q          all-reduce P (sum)      # (n, r); Q (m, r) is shared by every rank
    P = orthogonalise(P)
    Q = M^T P        all-reduce Q, / N       # (m, r)
    M_hat = P Q^T                            # the mean's rank-r approximation, same on every rank
    e = M - M_hat                            # (local gradient minus the shared approximation)

Bytes: (n + m) r per matrix instead of n m. Q is kept between steps (warm start: the power
iteration continues, so the approximation improves over steps) and drawn at random, the same
on every rank, the first time. Vectors (biases, norms) and matrices where (n + m) r x
min_compression_rate >= n m are all-reduced uncompressed, in one batch per bucket.

This is written to the same specification as torch's `powerSGD_hook` (start iteration with
plain all-reduce before it, per-bucket error and Q memories, the iteration counted when
the step's last bucket is done (`bucket.is_last()`), Gram-Schmidt for r <= 2 and QR above, Q's seeds drawn from a
`numpy.random.RandomState(random_seed)`, matrices grouped by shape in first-seen order), so
that the two agree numerically on the same gradients (`pytest -k compression_powersgd`).
Note what torch's error means for the uncompressed tensors: e = local - mean, whose sum over
ranks is zero, so it cancels in the next all-reduce (exactly, up to rounding).

Shape legend: n rows, m columns, r rank, N ranks. Lesson: lessons/10-compression.md.
"""

# No `from __future__ import annotations`: torch's DDP checks a hook's return annotation
# against the type itself (torch.futures.Future[torch.Tensor]), not its string.

import numpy as np
import torch
import torch.distributed as dist

from tinyscale.compression.base import completed, split_like
from tinyscale.dist import comm


class PowerSGDState:
    """PowerSGD's settings and memories (torch's argument names, so configs carry over)."""

    def __init__(self, process_group=None, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0):
        if matrix_approximation_rank < 1:
            raise ValueError(f"PowerSGD: matrix_approximation_rank={matrix_approximation_rank} must be >= 1")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(f"PowerSGD: start_powerSGD_iter={start_powerSGD_iter} must be > 1 with error "
                             "feedback or warm start (DDP rebuilds its buckets after the first step, which "
                             "would invalidate the per-bucket memories)")
        self.process_group = process_group
        self.rank, self.start_iter = matrix_approximation_rank, start_powerSGD_iter
        self.min_compression_rate, self.use_error_feedback = min_compression_rate, use_error_feedback
        self.warm_start, self.epsilon = warm_start, orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, list[torch.Tensor]] = {}
        self.iter = 0
        self.numel_before = self.numel_after = 0  # elements per bucket before / after compression

    def state_dict(self) -> dict:
        """The memories, the step count and Q's seed stream: what a dropped step must restore
        and a resume load. Errors are replaced each step; Qs are orthogonalised in place: copied."""
        kind, key, pos, has_gauss, gauss = self.rng.get_state()
        return {"iter": self.iter, "errors": dict(self.errors),
                "qs": {i: [q.clone() for q in qs] for i, qs in self.qs.items()},
                "rng": {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                        "gauss": float(gauss)}}  # tensors and numbers: a checkpoint loads weights_only

    def load_state_dict(self, state: dict) -> None:
        self.iter, self.errors = state["iter"], dict(state["errors"])
        self.qs = {i: [q.clone() for q in qs] for i, qs in state["qs"].items()}
        r = state["rng"]
        self.rng.set_state(("MT19937", r["key"].numpy().astype(np.uint32), r["pos"], r["has_gauss"], r["gauss"]))

    def worth_compressing(self, n: int, m: int) -> bool:
        r = min(n, m, self.rank)
        return (n + m) * r * self.min_compression_rate < n * m


def orthogonalise(mat: torch.Tensor, epsilon: float = 0) -> torch.Tensor:
    """Orthonormal columns spanning `mat` (n, r), in place: Gram-Schmidt for r <= 2 or half
    precision, else QR (the same choice as torch's hook, so results match). A zero column
    stays zero (torch's hook makes it NaN): a parameter unused in a step has a zero gradient."""
    r = mat.shape[1]
    if r <= 2 or mat.dtype in (torch.float16, torch.bfloat16):
        for i in range(r):
            col = mat[:, i : i + 1]  # (n, 1)
            norm = torch.linalg.vector_norm(col) + epsilon
            col /= torch.where(norm > 0, norm, torch.ones_like(norm))  # a zero column stays 0, not NaN
            if i + 1 < r:
                rest = mat[:, i + 1 :]  # (n, r - i - 1)
                rest -= (col * rest).sum(dim=0, keepdim=True) * col
        return mat
    mat.copy_(torch.linalg.qr(mat).Q)
    return mat


def _matrices(tensors: list[torch.Tensor], state: PowerSGDState):
    """Split a bucket's tensors: (compressed matrices grouped by shape, uncompressed tensors)."""
    by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    plain = []
    for t in tensors:
        mat = t.view(t.shape[0], -1) if t.dim() > 0 else t.view(1, 1)  # (n, m)
        if t.dim() > 1 and state.worth_compressing(*mat.shape):
            by_shape.setdefault(tuple(mat.shape), []).append(mat)
        else:
            plain.append(t)
    return [m for group in by_shape.values() for m in group], plain


# --8<-- [start:powersgd]
def powersgd_hook(state: PowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: PowerSGD after `start_powerSGD_iter` steps, the exact mean before."""
    group, flat = state.process_group, bucket.buffer()  # flat (n_bucket,): this rank's sum-form grads
    world = dist.get_world_size(group)
    index = bucket.index()
    if state.iter < state.start_iter:
        out = flat / world  # divided first, as torch's plain all-reduce hook does
        comm.all_reduce(out, group=group)
        _count_iter(state, bucket)
        return completed(out)
    if state.use_error_feedback:
        if index in state.errors:
            flat.add_(state.errors[index])
        before = flat.clone()
    mats, plain = _matrices(bucket.gradients(), state)
    if plain:  # vectors and small matrices: one uncompressed all-reduce of them all
        packed = torch.cat([t.reshape(-1) for t in plain])
        comm.all_reduce(packed, group=group)
        for t, mean in zip(plain, split_like(packed.div_(world), plain)):
            t.copy_(mean)
    ranks = [min(*m.shape, state.rank) for m in mats]
    qs = state.qs.get(index) if state.warm_start else None
    if qs is None:  # the same random Q on every rank: a seed from a generator every rank steps alike
        gen = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
        qs = [torch.randn(m.shape[1], r, generator=gen, dtype=flat.dtype).to(flat.device) for m, r in zip(mats, ranks)]
    for q in qs:
        orthogonalise(q, state.epsilon)
    ps = [m @ q for m, q in zip(mats, qs)]  # (n, r) each
    if ps:
        p_flat = torch.cat([p.reshape(-1) for p in ps])
        comm.all_reduce(p_flat, group=group)  # sum: orthogonalised next, so no need to divide
        ps = split_like(p_flat, ps)
        for p in ps:
            orthogonalise(p, state.epsilon)
        q_flat = torch.cat([(m.T @ p).reshape(-1) for m, p in zip(mats, ps)])  # (m, r) each
        comm.all_reduce(q_flat, group=group)
        fresh = split_like(q_flat.div_(world), qs)
        # A matrix zero on every rank (an unused parameter) gives Q = 0, from which the power
        # iteration never recovers (P = M Q = 0 ever after): it keeps its old Q instead.
        qs = [q if bool(q.any()) else old for q, old in zip(fresh, qs)]
        for m, p, q in zip(mats, ps, qs):
            m.copy_(p @ q.T)  # (n, m): the approximation of the mean, written into the bucket
    if state.use_error_feedback:
        state.errors[index] = before - flat
    if state.warm_start:
        state.qs[index] = qs
    _count_iter(state, bucket)
    return completed(flat)
# --8<-- [end:powersgd]


def _count_iter(state: PowerSGDState, bucket) -> None:
    if bucket.is_last():  # one step = every bucket once; the step's last bucket ends it
        state.iter += 1


def payload_elements(shapes: list[tuple[int, ...]], state: PowerSGDState) -> tuple[int, int, int]:
    """(uncompressed elements, P elements, Q elements) one bucket of these shapes sends per step."""
    plain = ps = qs = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        if len(shape) > 1 and state.worth_compressing(n, m):
            r = min(n, m, state.rank)
            ps, qs = ps + n * r, qs + m * r
        else:
            plain += int(np.prod(shape)) if shape else 1
    return plain, ps, qs
