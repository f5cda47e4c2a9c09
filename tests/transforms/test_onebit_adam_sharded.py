"""fn.transforms.onebit_adam_sharded is fn.onebit_adam's rule with the collectives' results
given: fed the mean gradient (warmup) and the 1-bit allreduce's momentum (compressed), it moves
the params of one rank exactly as fn.onebit_adam does on 2 simulated ranks."""

from __future__ import annotations

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
