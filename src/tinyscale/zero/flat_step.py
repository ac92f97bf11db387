"""The sharded step on flat tensors, a few per unit, as DeepSpeed's stages 1 and 2 step one
flat fp32 partition per parameter group.

`ShardedOptimizer` hands the torch optimizer one tensor per parameter *fragment* (the part of
a parameter in this rank's shard), so that per-parameter state, unused parameters and
checkpoints by name work as in one process. torch's AdamW on the CPU then loops in Python
over the fragments (18 on rank 0 of the small GPT's stage 1). For an elementwise optimizer
an element's update depends only on that element's gradient and state, the group's
hyperparameters and the step count, so stepping consecutive fragments of a unit as ONE
tensor, a *piece* (a contiguous range of the master shard, padding excluded; fragments are
gathered into pieces of up to `PIECE_BYTES`, 1 MiB, which stay in cache), gives the same bits,
provided every fragment in it is stepped and all have the same step count.

One source of truth: once a piece is *tied*, each fragment's tensor states (exp_avg,
exp_avg_sq, momentum_buffer) are views of the piece's flat state, so either path updates
the same memory, and after a flat step the piece's scalars (Adam's `step`) are copied into
every fragment's. The torch optimizer's per-fragment `state`, which checkpoints (by name,
DCP, universal), `set_lr` and the memory report read, keeps its format and values.

    flat = FlatStep.build(optimizer, fragments, sub_groups, master, unit_group)  # None: not exact
    rest = flat.prepare(s, grads, used)    # sub-group s: attaches the pieces it can step, returns
                                           # the (unit, fragment) pairs for the per-fragment path
    optimizer.step()                       # steps both (the pieces in a pre-hook)

The per-fragment path stays, for:
- an optimizer other than exactly torch.optim.Adam, AdamW or SGD, or a group with
  capturable, differentiable or fused set (a subclass, LAMB, Adafactor or a user's own may
  use per-tensor norms; those three flags are untested here, amsgrad and maximize are tested);
- the disk tier (offload nvme: its swapper moves each fragment's states by key);
- one piece for one step: some of its parameters got no gradient on any rank (those are
  skipped, the others stepped, as torch skips a None grad). Their step counts then differ
  (Adam), so when every parameter has a gradient again the piece is cut for good into runs of
  fragments whose scalars agree (`_split`), and each run steps flat: one tensor a run, the
  same bits as one a fragment. A piece with no gradient at all is not stepped.
A piece lies inside one unit and one sub-group (`sub_groups.py`), so sub-groups bound the
step's temporaries as before. Any step of the torch optimizer on a tied fragment (this
path) or a replaced state (a loaded checkpoint: `_still_tied`) unties the piece; the next flat step ties
it again from the fragments' states if their step counts agree. A scalar state (`step`)
written in place (a user resetting the counts) is seen by its version counter and unties too.
Tests: tests/zero/test_zero_flat_step.py (`pytest -k zero_flat`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLAT_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
# A piece holds consecutive fragments up to this many bytes of the master's dtype (a larger
# fragment is a piece alone). torch's CPU AdamW makes about eight passes over what it steps,
# so a piece should stay in cache: over the small GPT's 39 parameters (869,504 fp32
# elements, one process, 2026-11-27, load 4) one tensor took 3.9 ms of CPU, one per parameter
# 4.0, pieces of 1 MiB 3.1; over half of each (one rank's share of 2) 1.5, 3.3 and 1.55.
PIECE_BYTES = 2**20
# amsgrad (Adam's max_exp_avg_sq: an elementwise max) and maximize (the gradient negated) are
# elementwise too, and tested bit for bit; these three are not (capturable and fused: other kernels)
UNTESTED_FLAGS = ("capturable", "differentiable", "fused")


def not_flat_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why `optimizer` must keep the per-fragment step (None: the flat step is exact)."""
    if type(optimizer) not in FLAT_TYPES:
        return f"{type(optimizer).__name__} is not exactly torch.optim.Adam, AdamW or SGD"
    for group in optimizer.param_groups:
        for flag in UNTESTED_FLAGS:
            if group.get(flag):
                return f"a parameter group sets {flag}"
    return None


class Piece:
    """Unit `unit`'s fragments `ks` (consecutive), master[start:end] as one tensor (`view`)."""

    __slots__ = ("unit", "ks", "frags", "index", "start", "end", "view", "tied", "refs", "flat_refs", "versions")

    def __init__(self, unit: int, ks: list[int], frags: list, index: list[int], view: torch.Tensor):
        self.unit, self.ks, self.frags, self.index = unit, ks, frags, index
        self.start, self.end, self.view = frags[0].start, frags[-1].end, view
        self.tied = False
        self.refs: list = []  # per fragment: (its state dict, its values) as tied
        self.flat_refs: dict = {}  # the flat state's values as tied
        self.versions: list = []  # per fragment: its scalar states' version counters as last written by us


class FlatStep:
    """The pieces of every sub-group and a second torch optimizer (same type) stepping them."""

    def __init__(self, main: torch.optim.Optimizer, pieces: list[list[Piece]], groups: list[list[Piece]]):
        self.main, self.pieces = main, pieces
        flat_cls = type(main)
        # torch.optim.Optimizer's own constructor with the main optimizer's defaults: the type's
        # __init__ only validates them and sets fused-only flags (fused is refused above)
        self.flat = flat_cls.__new__(flat_cls)
        torch.optim.Optimizer.__init__(self.flat, [{**{k: v for k, v in g.items() if k != "params"},
                                                    "params": [p.view for p in ps]}
                                                   for g, ps in zip(main.param_groups, groups)], dict(main.defaults))
        self.stepped = 0  # pieces stepped flat so far (tests and benchmarks read it)
        self._pending: list[Piece] = []  # attached by `prepare`, stepped by the main optimizer's step
        # The flat step runs inside the torch optimizer's step (a pre-hook), so whatever wraps or
        # watches that (a torch LR scheduler's call counter, a test's patch) sees one step as before.
        main.register_step_pre_hook(self._run)
        main.register_step_post_hook(self._after_main_step)

    @classmethod
    def build(cls, main: torch.optim.Optimizer, fragments: Sequence[Sequence], sub_groups: Sequence[Sequence],
              master: Sequence[torch.Tensor], unit_group: Sequence[int], index: dict[int, int]) -> FlatStep | None:
        """None where the flat step is not exact (`not_flat_reason`) or this rank steps nothing.
        `unit_group[i]`: unit i's index in `main.param_groups`; `index`: id(param) -> usage flag."""
        if not_flat_reason(main) is not None or not any(fragments):
            return None
        pieces: list[list[Piece]] = []
        groups: list[list[Piece]] = [[] for _ in main.param_groups]
        for sub in sub_groups:
            runs: list[tuple[int, list[int]]] = []  # (unit, consecutive fragments), at most `cap` elements
            for i, k in sub:
                cap = max(1, PIECE_BYTES // master[i].element_size())
                f = fragments[i][k]
                if runs and runs[-1][0] == i and f.end - fragments[i][runs[-1][1][0]].start <= cap:
                    runs[-1][1].append(k)
                else:
                    runs.append((i, [k]))
            row = []
            for i, ks in runs:
                frags = [fragments[i][k] for k in ks]
                piece = Piece(i, ks, frags, [index[id(f.param)] for f in frags],
                              master[i][frags[0].start:frags[-1].end])
                row.append(piece)
                groups[unit_group[i]].append(piece)
            pieces.append(row)
        return cls(main, pieces, groups)

    def _untie(self, piece: Piece) -> None:
        if piece.tied:
            piece.tied, piece.refs, piece.flat_refs, piece.versions = False, [], {}, []
            self.flat.state.pop(piece.view, None)  # the fragments' views keep the memory

    def _after_main_step(self, _opt, _args, _kwargs) -> None:
        """The torch optimizer stepped some fragments: their pieces' flat scalars are stale."""
        for row in self.pieces:
            for piece in row:
                if piece.tied and any(f.view.grad is not None for f in piece.frags):
                    self._untie(piece)

    def _still_tied(self, piece: Piece) -> bool:
        """Each fragment's state dict and values are those tied, and its scalars hold what the
        last flat step wrote. A loader that replaces them (`state_dict.load_optimizer_state`'s
        scalars, DCP's dicts, torch's `load_state_dict`) or writes a scalar in place (its
        version counter moves) unties the piece. (Tensor states are views of the flat ones:
        writing them in place writes the flat state, which stays right.)"""
        state = self.main.state
        for f, (d, values), versions in zip(piece.frags, piece.refs, piece.versions):
            if state.get(f.view) is not d or len(d) != len(values) or \
                    any(a is not b for a, b in zip(d.values(), values)) or \
                    any(v._version != n for v, n in versions):
                return False
        return True

    def _ready(self, piece: Piece) -> bool:
        """Whether the piece can step flat now: tied, or fresh (no state anywhere: torch
        initialises the flat state, tied after the step), or tied now from its fragments'
        states (their scalars all equal, their tensors concatenated into the flat state)."""
        if piece.tied:
            if self._still_tied(piece):
                return True
            self._untie(piece)
        states = [self.main.state.get(f.view) for f in piece.frags]
        if not any(states):
            self.flat.state.pop(piece.view, None)
            return True
        if not all(states) or any(st.keys() != states[0].keys() for st in states):
            return False
        flat: dict = {}
        for key, first in states[0].items():
            values = [st[key] for st in states]
            if torch.is_tensor(first) and first.dim() > 0:
                if any(not torch.is_tensor(v) or v.dim() != 1 or v.dtype != first.dtype or v.device != first.device
                       for v in values):
                    return False
                flat[key] = torch.cat(values)
            elif torch.is_tensor(first):
                if any(not torch.is_tensor(v) or v.shape != first.shape or v.dtype != first.dtype or
                       not torch.equal(v, first) for v in values):
                    return False
                flat[key] = first.clone()
            else:
                if any(torch.is_tensor(v) or v != first for v in values):
                    return False
                flat[key] = first
        self.flat.state[piece.view] = flat
        self._tie(piece)
        return True

    def _tie(self, piece: Piece) -> None:
        """Each fragment's state := views of the flat state's tensors, copies of its scalars."""
        flat = self.flat.state[piece.view]
        piece.refs = []
        for f in piece.frags:
            a, b = f.start - piece.start, f.end - piece.start
            d = {k: (v[a:b] if v.dim() > 0 else v.clone()) if torch.is_tensor(v) else v for k, v in flat.items()}
            self.main.state[f.view] = d
            piece.refs.append((d, tuple(d.values())))
        piece.flat_refs = dict(flat)
        piece.tied = True
        self._note_versions(piece)

    @staticmethod
    def _note_versions(piece: Piece) -> None:
        piece.versions = [[(v, v._version) for v in d.values() if torch.is_tensor(v) and v.dim() == 0]
                          for d, _ in piece.refs]

    def _split(self, s: int, piece: Piece) -> list[Piece] | None:
        """Cut `piece` for good into runs of consecutive fragments whose states agree in their
        keys and scalars (Adam's step counts differ after a parameter was skipped), each run a
        piece of its own in the flat optimizer's group; None if every fragment agrees (the
        piece cannot tie for another reason, and stays per fragment)."""
        def scalars(st):
            return None if not st else [(k, v.item() if v.dim() == 0 else None) if torch.is_tensor(v) else (k, v)
                                        for k, v in st.items()]
        runs: list[list[int]] = []  # positions in piece.frags
        last = object()
        for j, f in enumerate(piece.frags):
            sig = scalars(self.main.state.get(f.view))
            if runs and sig == last:
                runs[-1].append(j)
            else:
                runs.append([j])
            last = sig
        if len(runs) == 1:
            return None
        self._untie(piece)
        subs = []
        for run in runs:
            frags = [piece.frags[j] for j in run]
            a, b = frags[0].start - piece.start, frags[-1].end - piece.start
            subs.append(Piece(piece.unit, [piece.ks[j] for j in run], frags, [piece.index[j] for j in run],
                              piece.view[a:b]))
        for group in self.flat.param_groups:  # the flat optimizer steps the runs in the piece's place
            at = next((j for j, p in enumerate(group["params"]) if p is piece.view), None)
            if at is not None:
                group["params"][at:at + 1] = [sub.view for sub in subs]
        row = self.pieces[s]
        at = next(j for j, p in enumerate(row) if p is piece)
        row[at:at + 1] = subs
        return subs

    def prepare(self, s: int, grads: Sequence[torch.Tensor | None],
                used: Sequence[bool] | None) -> list[tuple[int, int]]:
        """Attach the gradient of each of sub-group s's pieces that can step flat (stepped by the
        torch optimizer's next step); return the (unit, fragment) pairs left for the per-fragment
        path (pieces some of whose parameters got no gradient, or whose states are not tied)."""
        self.detach()  # (a step that raised left its pieces attached)
        rest = []
        for piece in list(self.pieces[s]):  # (a copy: `_split` replaces pieces in the row)
            g = grads[piece.unit]
            if g is None:
                continue  # no gradient in the unit: nothing to step either way
            n_used = len(piece.index) if used is None else sum(1 for k in piece.index if used[k])
            if n_used == 0:
                continue
            if n_used < len(piece.index):
                rest += [(piece.unit, k) for k in piece.ks]
                continue
            runs = [piece] if self._ready(piece) else self._split(s, piece) or []
            if not runs:  # the fragments' states agree but cannot tie: per fragment
                rest += [(piece.unit, k) for k in piece.ks]
            for run in runs:
                if run is not piece and not self._ready(run):
                    rest += [(run.unit, k) for k in run.ks]
                    continue
                run.view.grad = g[run.start:run.end].to(run.view.device)  # (offload cpu: to the host)
                self._pending.append(run)
        return rest

    def detach(self) -> None:
        """Drop the gradients of pieces attached and not stepped (the step raised)."""
        for piece in self._pending:
            piece.view.grad = None
        self._pending = []

    def _run(self, _opt, _args, _kwargs) -> None:
        """Step the attached pieces; then each fragment's scalars := its piece's."""
        stepped, self._pending = self._pending, []
        if not stepped:
            return
        for flat_group, group in zip(self.flat.param_groups, self.main.param_groups):
            flat_group.update((k, v) for k, v in group.items() if k != "params")  # set_lr, schedules
        try:
            self.flat.step()
        finally:
            for piece in stepped:
                piece.view.grad = None
        dst, src = [], []
        for piece in stepped:
            flat = self.flat.state[piece.view]
            refs = piece.flat_refs
            if not piece.tied or flat.keys() != refs.keys() or any(
                    (v is not refs[k]) if torch.is_tensor(v) and v.dim() > 0 else
                    (not torch.is_tensor(v) and v != refs[k]) for k, v in flat.items()):
                self._tie(piece)  # first step (torch made the state), or a state replaced
                continue
            for d, _ in piece.refs:
                for k, v in flat.items():
                    if torch.is_tensor(v) and v.dim() == 0:
                        dst.append(d[k])
                        src.append(v)
        if dst:
            torch._foreach_copy_(dst, src)  # Adam's step counts: one call for every fragment
            for piece in stepped:
                self._note_versions(piece)  # our own writes: not a user's
        self.stepped += len(stepped)
