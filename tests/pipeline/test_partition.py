"""Stage partitioning: every block once, in order, embedding first and head last, the cut that
minimises the slowest stage (checked against brute force), and clear errors."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.models import GPT, GPTConfig
from tinyscale.pipeline.partition import balanced_split, gpt_param_costs, partition_gpt, stages_on_rank


def _brute_force_best(costs, parts, first_extra, last_extra):
    """(smallest bottleneck, then smallest sum of squares) over every cut."""
    n, best = len(costs), (float("inf"), float("inf"))
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += first_extra
        loads[-1] += last_extra
        best = min(best, (max(loads), sum(x * x for x in loads)))
    return best


@given(costs=st.lists(st.integers(0, 20), min_size=1, max_size=8), data=st.data())
def test_pp_partition_minimises_the_slowest_stage_then_imbalance(costs, data):
    parts = data.draw(st.integers(1, len(costs)))
    first, last = data.draw(st.integers(0, 30)), data.draw(st.integers(0, 30))
    runs = balanced_split(costs, parts, first_extra=first, last_extra=last)
    assert [i for run in runs for i in run] == list(range(len(costs)))  # contiguous, in order, once
    assert all(len(run) > 0 for run in runs)
    loads = [sum(costs[i] for i in run) for run in runs]
    loads[0] += first
    loads[-1] += last
    assert (max(loads), sum(x * x for x in loads)) == _brute_force_best(costs, parts, first, last)


@given(layers=st.integers(1, 40), data=st.data())
def test_pp_partition_equal_layers_split_evenly_extra_ones_last(layers, data):
    parts = data.draw(st.integers(1, layers))
    sizes = [len(run) for run in balanced_split([1] * layers, parts)]
    small = layers // parts
    assert sizes == [small] * (parts - layers % parts) + [small + 1] * (layers % parts)


@given(n_layer=st.integers(1, 12), p=st.integers(1, 4), v=st.integers(1, 3), tied=st.booleans())
def test_pp_partition_gpt_places_every_block_once(n_layer, p, v, tied):
    config = GPTConfig(n_layer=n_layer, d_model=32, n_head=4, tie_embeddings=tied)
    if p * v > n_layer:
        with pytest.raises(ValueError, match=f"num_stages={p} x virtual_stages={v} = {p * v} stages "
                                             f"but the GPT has n_layer={n_layer}"):
            partition_gpt(config, p, virtual_stages=v)
        return
    plan = partition_gpt(config, p, virtual_stages=v)
    assert [st.stage for st in plan] == list(range(p * v))
    assert [i for st in plan for i in st.layers] == list(range(n_layer))
    assert all(st.layers for st in plan)
    assert [st.embedding for st in plan] == [True] + [False] * (p * v - 1)
    assert [st.head for st in plan] == [False] * (p * v - 1) + [True]
    assert all((st.rank, st.chunk) == (st.stage % p, st.stage // p) for st in plan)
    assert [st.chunk for st in stages_on_rank(plan, p - 1)] == list(range(v))
    # Parameter counts: the model's own, plus the last stage's copy of a tied table.
    model_params = sum(t.numel() for t in GPT(config).parameters())
    assert sum(st.cost for st in plan) == model_params + (config.vocab_size * config.d_model if tied else 0)


def test_pp_partition_param_counts_match_the_model():
    config = GPTConfig.preset("tiny")
    model = GPT(config)
    embedding, blocks, head = gpt_param_costs(config)
    assert embedding == model.embed.weight.numel()
    assert blocks == [sum(t.numel() for t in block.parameters()) for block in model.blocks]
    assert head == model.head.weight.numel() + model.norm.weight.numel()


def test_pp_partition_heavy_embedding_gets_fewer_blocks():
    """llama-1b's shapes: the 128256 x 2048 embedding is worth ~4 blocks of parameters."""
    plan = partition_gpt(GPTConfig.preset("llama-1b"), 4)
    assert [len(st.layers) for st in plan] == [2, 6, 6, 2]


def test_pp_partition_measured_costs_isolate_a_slow_layer():
    config = GPTConfig(n_layer=5)
    plan = partition_gpt(config, 3, layer_costs=[1, 1, 10, 1, 1])
    assert [st.layers for st in plan] == [(0, 1), (2,), (3, 4)]


def test_pp_partition_embedding_and_head_costs_take_blocks_away():
    config = GPTConfig(n_layer=6)
    sizes = lambda plan: [len(st.layers) for st in plan]  # noqa: E731
    assert sizes(partition_gpt(config, 3, layer_costs=[1] * 6)) == [2, 2, 2]
    assert sizes(partition_gpt(config, 3, layer_costs=[1] * 6, head_cost=2)) == [2, 3, 1]
    assert sizes(partition_gpt(config, 3, layer_costs=[1] * 6, embedding_cost=2)) == [1, 2, 3]


@pytest.mark.parametrize("costs", [[1, 2], [1, 2, -1], [1, 2, float("nan")]])
def test_pp_partition_rejects_bad_layer_costs(costs):
    with pytest.raises(ValueError, match=r"layer_costs has .* one cost >= 0 per block, n_layer=3"):
        partition_gpt(GPTConfig(n_layer=3), 2, layer_costs=costs)
