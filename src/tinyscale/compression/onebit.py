"""1-bit Adam (Tang et al. 2021): exact Adam while the variance settles, then the variance
frozen and only the momentum communicated, one bit per element with error compensation.

Why it works: Adam's update is m / (sqrt(v) + eps). Once v has stopped moving much (after a
warm-up of `freeze_step` steps), it can be frozen as a per-element preconditioner; then the
update is linear in m, and m is a running average of gradients, so ranks can average m
instead of the gradient. m tolerates heavy compression when the error is fed back.

    warm-up (step < freeze_step):  g = all-reduce mean of gradients; AdamW exactly
    compression stage:             m_local = b1 m + (1 - b1) g_local      (no gradient all-reduce)
                                   m = compressed_allreduce(m_local)       (same m on every rank)
                                   p -= lr (m / bc1) / (sqrt(v_frozen / bc2_frozen) + eps) + decay

`compressed_allreduce` is the paper's two-phase scheme (sec. 4.2): every rank adds its worker
error, splits the vector into N chunks and sends chunk j, compressed to signs and one scale
(mean |x| of the chunk), to rank j (all-to-all); rank j averages the N decompressed chunks,
adds its server error, compresses again and all-gathers. Each phase moves about n/8 bytes
per rank instead of 4n (fp32): ~32x less than an all-reduce's payload. Both errors are kept
(e = x - decompress(compress(x))), so nothing is lost, only delayed.

The optimizer owns the gradient communication of its group: use it on a model that is not
wrapped in a DDP. A parameter with no gradient on this rank contributes zeros; one that no
rank used is not stepped in the warm-up (as AdamW; usage flags ride in its all-reduce).
After it, the parameters used in the warm-up are stepped (no gradient: zeros) with their
variance frozen; the others have no variance to freeze, so they stay exact: their gradients
(and usage flags) go through one all-reduce each step, and from the first step some rank uses
one it trains as AdamW would (state "exact"), never compressed.
Shape legend: n elements of all parameters, N ranks.
Lesson: lessons/10-compression.md. Tests: `pytest -k compression_onebit`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tinyscale.compression.base import split_like
from tinyscale.dist import comm

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """(c,) -> uint8 (ceil(c/8),): bit i of byte j is 1 where x[8j + i] >= 0."""
    bits = (x >= 0).to(torch.uint8)
    bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)]).view(-1, 8)  # (ceil(c/8), 8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(dim=1).to(torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `pack_signs` as +1/-1 of `dtype`: uint8 (ceil(c/8),) -> (c,)."""
    bits = (packed.unsqueeze(1) & _BIT_WEIGHTS.to(packed.device)) > 0  # (ceil(c/8), 8)
    return bits.view(-1)[:numel].to(dtype) * 2 - 1


def one_bit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (c,) -> (packed signs, scale (1,)); decompressed: sign * scale, scale = mean |x| (so
    the compressed chunk keeps x's l1 norm)."""
    return pack_signs(x), x.abs().mean().reshape(1)


# --8<-- [start:compressed_allreduce]
def compressed_allreduce(x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         group=None) -> torch.Tensor:
    """The mean over `group` of every rank's x (n,), 1-bit compressed twice with error
    compensation; updates both errors in place. n must be a multiple of N (pad first)."""
    world = dist.get_world_size(group)
    chunk = x.numel() // world
    x = x + worker_error
    signs, scales = zip(*(one_bit(c) for c in x.view(world, chunk)))  # one (signs, scale) per chunk
    worker_error.copy_(x - torch.cat([unpack_signs(s, chunk, x.dtype) * a for s, a in zip(signs, scales)]))
    sign_bytes = signs[0].numel()
    mine_signs = torch.empty(world * sign_bytes, dtype=torch.uint8, device=x.device)
    mine_scales = torch.empty(world, dtype=x.dtype, device=x.device)
    comm.all_to_all(mine_signs, torch.cat(signs), group=group)  # rank j gets every rank's chunk j
    comm.all_to_all(mine_scales, torch.cat(scales), group=group)
    avg = sum(unpack_signs(s, chunk, x.dtype) * a
              for s, a in zip(mine_signs.view(world, sign_bytes), mine_scales)) / world  # (chunk,)
    y = avg + server_error
    s_signs, s_scale = one_bit(y)
    server_error.copy_(y - unpack_signs(s_signs, chunk, x.dtype) * s_scale)
    all_signs = torch.empty(world * sign_bytes, dtype=torch.uint8, device=x.device)
    all_scales = torch.empty(world, dtype=x.dtype, device=x.device)
    comm.all_gather(all_signs, s_signs, group=group)
    comm.all_gather(all_scales, s_scale, group=group)
    return torch.cat([unpack_signs(s, chunk, x.dtype) * a
                      for s, a in zip(all_signs.view(world, sign_bytes), all_scales)])
# --8<-- [end:compressed_allreduce]


def onebit_bytes(numel: int, world: int, dtype: torch.dtype) -> int:
    """Ledger bytes of one compressed_allreduce of `numel` (padded to N) elements: two
    all-to-alls (signs, scales) and two all-gathers (signs, scales)."""
    chunk = math.ceil(numel / world)
    signs = world * math.ceil(chunk / 8)
    return 2 * (signs + world * dtype.itemsize)


class OneBitAdam(torch.optim.Optimizer):
    """1-bit Adam with AdamW's decoupled weight decay; communicates over `group` itself."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, freeze_step: int = 100, group=None):
        if freeze_step < 1:
            raise ValueError(f"OneBitAdam: freeze_step={freeze_step} must be >= 1 (Adam's variance needs "
                             "exact steps before it is frozen)")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.freeze_step, self.group, self.steps = freeze_step, group, 0
        self.worker_error = self.server_error = None
        # agree(params, momenta): makes copies of one parameter on other ranks (tensor-parallel
        # replicas, a pipeline's tied table) hold the same averaged momentum; set by the engine.
        self.agree = None

    def comm_state(self) -> dict:
        """What `state_dict` lacks for a resume: the step count and this rank's two errors (not
        the per-parameter states, which the optimizer's state holds). Copies."""
        errors = {"worker_error": self.worker_error, "server_error": self.server_error}
        return {"steps": self.steps, **{k: None if t is None else t.clone() for k, t in errors.items()}}

    def load_comm_state(self, state: dict) -> None:
        self.steps, self.worker_error, self.server_error = state["steps"], state["worker_error"], state["server_error"]

    @torch.no_grad()
    def step(self, closure=None):
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        used = [p.grad is not None for p in params]  # on this rank
        self.steps += 1
        warmup = self.steps <= self.freeze_step
        if warmup and world > 1:  # exact: the mean gradient, one all-reduce (usage flags ride along)
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(world)
            flat = torch.cat([flat, torch.tensor(used, dtype=flat.dtype, device=flat.device)])
            comm.all_reduce(flat, group=self.group)
            grads, used = split_like(flat, params), (flat[flat.numel() - len(params):] > 0).tolist()
        if warmup:  # as AdamW: a parameter no rank used is not stepped (no state, no decay)
            stepped = {p for p, u in zip(params, used) if u}
            for p in stepped:
                if not self.state[p]:
                    self.state[p].update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        else:  # the parameters with a variance to freeze: those used in the warm-up (the same on every rank)
            stepped = {p for p in params if "bc2" in self.state[p] and not self.state[p].get("exact")}
            # --8<-- [start:late]
            late = [i for i, p in enumerate(params) if p not in stepped]  # no rank used them in the warm-up
            if late and world > 1:  # exact, as in the warm-up: their mean gradients and usage flags
                flat = torch.cat([grads[i].reshape(-1) for i in late]).div_(world)
                flat = torch.cat([flat, torch.tensor([used[i] for i in late], dtype=flat.dtype, device=flat.device)])
                comm.all_reduce(flat, group=self.group)
                for i, g, u in zip(late, split_like(flat, [params[i] for i in late]), flat[-len(late):].tolist()):
                    grads[i], used[i] = g, u > 0
            for i in late:
                if used[i] and not self.state[params[i]]:  # first used now: AdamW from here on
                    self.state[params[i]].update(step=0, exp_avg=torch.zeros_like(params[i]),
                                                 exp_avg_sq=torch.zeros_like(params[i]), exact=True)
            exact = {params[i] for i in late if used[i]}  # as AdamW: an unused one is not stepped
            # --8<-- [end:late]
            self._compressed_momentum([p for p in params if p in stepped],
                                      [g for p, g in zip(params, grads) if p in stepped], world)
            stepped |= exact
        self._update(params, grads, warmup, stepped)

    def _compressed_momentum(self, params, grads, world: int) -> None:
        b1 = self.param_groups[0]["betas"][0]
        m_local = torch.cat([(b1 * self.state[p]["exp_avg"] + (1 - b1) * g).reshape(-1)
                             for p, g in zip(params, grads)])  # (n,)
        pad = -m_local.numel() % max(world, 1)
        m_local = torch.cat([m_local, m_local.new_zeros(pad)])
        if world == 1:
            m = m_local
        else:
            if self.worker_error is None:
                self.worker_error = torch.zeros_like(m_local)
                self.server_error = m_local.new_zeros(m_local.numel() // world)
            m = compressed_allreduce(m_local, self.worker_error, self.server_error, self.group)
        parts = split_like(m[: m.numel() - pad], params)
        if self.agree is not None and world > 1:  # compressed per rank's flat vector: copies differ
            self.agree(params, parts)
        for p, part in zip(params, parts):
            self.state[p]["exp_avg"].copy_(part)

    def _update(self, params, grads, warmup: bool, stepped: set) -> None:
        i = 0
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                state, g = self.state[p], grads[i]
                i += 1
                if p not in stepped:
                    continue
                state["step"] += 1  # per parameter, as AdamW's bias corrections count
                if warmup or state.get("exact"):
                    state["exp_avg"].lerp_(g, 1 - b1)  # AdamW's own arithmetic, so warm-up equals it
                    state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                    state["bc2"] = 1 - b2 ** state["step"]  # frozen with v after the warm-up
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(state["bc2"])).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** state["step"]))
