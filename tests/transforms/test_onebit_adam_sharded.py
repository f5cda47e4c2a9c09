"""fn.transforms.onebit_adam_sharded is fn.onebit_adam's rule with the collectives' results
given: fed the mean gradient (warmup) and the 1-bit allreduce's momentum (compressed), it moves
the params of one rank exactly as fn.onebit_adam does on 2 simulated ranks."""

from __future__ import annotations

import pytest
import torch

import fn
from fn.collectives import Simulated, replicate, simulate

HYPER = dict(lr=0.05, freeze_step=3, weight_decay=0.01)


def test_sharded_rule_moves_a_rank_s_params_as_onebit_adam():
    comm = Simulated(2)
    full = fn.onebit_adam(**HYPER, comm=comm)
    sharded = fn.transforms.onebit_adam_sharded(**HYPER)
    params = {"w": torch.randn(4, 6, generator=torch.Generator().manual_seed(0))}
    ranks = replicate(params, comm)
    state = replicate(full.init(params), comm)
    mine, my_state = dict(params), sharded.init(params)
    update = simulate(full.update, comm)
    momentum = simulate(fn.transforms.momentum_of, comm)
    g = torch.Generator().manual_seed(1)
    for t in range(1, 7):
        grads = {"w": torch.randn(2, 4, 6, generator=g)}
        updates, state = update(grads, state, ranks, step=t)
        ranks = fn.apply_updates(ranks, updates)
        given = (grads["w"][0] + grads["w"][1]) / 2 if t < 3 else momentum(state)["w"][0]
        updates, my_state = sharded.update({"w": given}, my_state, mine, step=t)
        mine = fn.apply_updates(mine, updates)
        assert torch.equal(mine["w"], ranks["w"][0]), t
    assert sharded.is_compressed(3) and not sharded.is_compressed(2)


AUTO = dict(lr=0.05, freeze_step=fn.AutoFreeze(2, 12, 0.7), betas=(0.8, 0.95))
SHAPES = {"w": (4, 6), "b": (6,)}


def _auto_grads(t, g):
    """Two ranks' gradients of update ``t``: a scale that decays, then settles."""
    scale = 1.0 + 4.0 * torch.exp(torch.tensor(-t / 2.0))
    return {k: scale * torch.randn(2, *s, generator=g) for k, s in SHAPES.items()}


def _run_auto(shards):
    """fn.onebit_adam with freeze_step=AUTO on 2 simulated ranks, and alongside it one
    onebit_adam_sharded per shard (``shards``: per shard, per leaf, the rows it holds), each
    given its rows of the mean gradient (warmup) or of the momentum (compressed) and the
    gradient energy summed over the shards. Returns the params after every update (the full
    run's rank 0, and each shard's) and the final states."""
    comm = Simulated(2)
    full = fn.onebit_adam(**AUTO, comm=comm)
    sharded = fn.transforms.onebit_adam_sharded(**AUTO)
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    ranks, state = replicate(params, comm), replicate(full.init(params), comm)
    pieces = [{k: params[k][rows] for k, rows in shard.items()} for shard in shards]
    states = [sharded.init(piece) for piece in pieces]
    update = simulate(full.update, comm)
    momentum = simulate(fn.transforms.momentum_of, comm)
    g, history = torch.Generator().manual_seed(1), []
    for t in range(1, 15):
        grads = _auto_grads(t, g)
        compressed = full.is_compressed(t, state)
        updates, state = update(grads, state, ranks, step=t)
        ranks = fn.apply_updates(ranks, updates)
        if compressed:
            given = {k: v[0] for k, v in momentum(state).items()}
        else:
            given = {k: (v[0] + v[1]) / 2 for k, v in grads.items()}
        mine = [{k: given[k][rows] for k, rows in shard.items()} for shard in shards]
        energy = sum(fn.transforms.gradient_energy(m) for m in mine)  # the callers' allreduce
        for i, shard_grads in enumerate(mine):
            updates, states[i] = sharded.update(
                shard_grads, states[i], pieces[i], step=t, gradient_energy=energy
            )
            pieces[i] = fn.apply_updates(pieces[i], updates)
        history.append(({k: v[0] for k, v in ranks.items()}, [dict(p) for p in pieces]))
    return history, state, states


def test_sharded_auto_switch_halves_of_every_leaf():
    """Two 'ranks' holding the first and the second half of every leaf (rows, as FSDP2 shards
    dim 0) decide the same switch as each other and as the unsharded optimizer here, and move
    their rows as it does. (Their energy sums the halves' RMS, each rounded to fp32, so it may
    differ from the unsharded one in the last bits: the decision can differ only where the
    criterion is within that rounding of its threshold.)"""
    shards = [{"w": slice(0, 2), "b": slice(0, 3)}, {"w": slice(2, 4), "b": slice(3, 6)}]
    history, state, states = _run_auto(shards)
    decided = int(state.auto.freeze_at[0])
    assert AUTO["freeze_step"].min_updates < decided <= AUTO["freeze_step"].max_updates
    assert [int(s.auto.freeze_at) for s in states] == [decided, decided]
    for full, pieces in history:
        for shard, piece in zip(shards, pieces, strict=True):
            for k, rows in shard.items():
                assert torch.equal(piece[k], full[k][rows])
    got, want = float(states[0].auto.variance_sum), float(state.auto.variance_sum[0])
    assert abs(got - want) <= 1e-6 * want


def test_sharded_auto_switch_whole_leaves_is_the_unsharded_one_bit_for_bit():
    """Shards of whole leaves, summed in the leaves' order, give the unsharded energy bit for
    bit, so the same statistics and the same switch."""
    shards = [{"w": slice(None)}, {"b": slice(None)}]
    _, state, states = _run_auto(shards)
    for mine in states:
        for field in ("freeze_at", "variance_sum", "recent_energy"):
            assert torch.equal(getattr(mine.auto, field), getattr(state.auto, field)[0])
    assert int(state.auto.freeze_at[0]) <= AUTO["freeze_step"].max_updates


def test_sharded_auto_warmup_needs_the_gradient_energy():
    opt = fn.transforms.onebit_adam_sharded(**AUTO)
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    for bad in (None, torch.tensor(1.0), torch.ones(1, dtype=torch.float64)):
        extra = {} if bad is None else {"gradient_energy": bad}
        with pytest.raises(TypeError, match="gradient_energy"):
            opt.update({"w": torch.ones(3)}, state, params, step=1, **extra)
    energy = fn.transforms.gradient_energy({"w": torch.ones(3)})
    _, state = opt.update({"w": torch.ones(3)}, state, params, step=1, gradient_energy=energy)
    assert int(state.count) == 1 and float(state.auto.variance_sum) == (1 - 0.95) * 3
