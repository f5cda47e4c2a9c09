"""An fn.optim optimizer under a DDP model that fn was not told about (fn.optim._ddp_detection):
one warning naming the fix at the first step, none when registered, on local gradients, on
all-zero gradients, or with one rank; the check is made once."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import fn
import fn.ddp
import fn.optim
from fn.collectives import Local
from fn.optim._ddp_detection import averaged_already
from tests._distributed import run_distributed
from tests.optim._problem import backward, flat_params, make_model

STEPS = 4


def _run(rank, make, *, wrap=False, register=False, same_batch=False, zero=False):
    """The fn.optim warnings of ``STEPS`` steps, the params after them and fn's bytes."""
    model = make_model()
    opt = make(model.parameters())
    net = DDP(model) if wrap else model
    if register:
        fn.ddp.register(net, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(STEPS):
            opt.zero_grad()
            if zero:
                net(torch.zeros(2, 5)).sum().mul(0.0).backward()
            else:
                backward(net, 0 if same_batch else rank, t)
            opt.step()
    ours = [w for w in caught if "fn.optim" in str(w.message)]
    return {
        "warnings": [str(w.message) for w in ours],
        "where": [w.filename for w in ours],  # the line that called opt.step()
        "params": flat_params(model),
    }


def onebit(ps):
    return fn.optim.OnebitAdam(ps, lr=1e-2, freeze_step=2)


def adam(ps):
    return fn.optim.FunctionalOptimizer(ps, fn.adam(lr=1e-2))


def _worker(rank, world_size):
    del world_size
    return {
        "ddp": _run(rank, onebit, wrap=True),
        "lamb_ddp": _run(rank, lambda ps: fn.optim.OnebitLamb(ps, freeze_step=2), wrap=True),
        "registered": _run(rank, onebit, wrap=True, register=True),
        "bare": _run(rank, onebit),
        "same_batch": _run(rank, onebit, same_batch=True),
        "zero": _run(rank, onebit, zero=True),
        "adam_ddp": _run(rank, adam, wrap=True),
        "adam_synced_by_ddp": _run(
            rank,
            lambda ps: fn.optim.FunctionalOptimizer(ps, fn.adam(lr=1e-2), sync_grads=False),
            wrap=True,
        ),
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=150)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_unregistered_ddp_warns_once_with_the_fix(results):
    for rank, result in enumerate(results):
        for case in ("ddp", "lamb_ddp"):
            (message,) = result[case]["warnings"]  # once, although STEPS steps ran
            assert "bit-identical on all 2 ranks" in message, (rank, message)
            assert "fn.ddp.register(ddp_model, opt)" in message
            assert "fn.integrations.lightning.FnCallback()" in message
            assert "saves no traffic" in message
            assert result[case]["where"] == [__file__], result[case]["where"]
        (message,) = result["adam_ddp"]["warnings"]
        assert "sync_grads=False" in message and "fn.ddp.register" not in message


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_no_warning_where_nothing_was_averaged_twice(results):
    for result in results:
        for case in ("registered", "bare", "zero", "adam_synced_by_ddp"):
            assert result[case]["warnings"] == [], case
    # the warning changes nothing: the ranks still agree
    assert torch.equal(results[0]["ddp"]["params"], results[1]["ddp"]["params"])


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_the_same_batch_on_every_rank_is_reported_too(results):
    for result in results:
        (message,) = result["same_batch"]["warnings"]
        assert "same batch on purpose" in message


def test_one_rank_never_checks():
    model = make_model()
    opt = fn.optim.OnebitAdam(model.parameters(), freeze_step=2, comm=Local())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backward(model, 0, 0)
        opt.step()
    assert not opt._averaging_unchecked


def test_averaged_already_on_simulated_fingerprints():
    class TwoRanks:
        """A comm whose all_gather stacks this rank's row and a given other rank's row."""

        world_size = 2

        def __init__(self, other):
            self.other = other

        def all_gather(self, x):
            return torch.stack([x, self.other])

    from fn.optim._ddp_detection import _fingerprint

    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    swapped = torch.tensor([2.0, 1.0, 3.0, 4.0])  # the same elements, in another order
    assert averaged_already(TwoRanks(_fingerprint(g)), [g])
    assert not averaged_already(TwoRanks(_fingerprint(swapped)), [g])
    assert not averaged_already(TwoRanks(_fingerprint(torch.zeros(4))), [torch.zeros(4)])
