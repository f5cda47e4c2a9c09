"""fn/collectives/dcp.py: the per-rank key convention, and the two reads of DCP's state-dict
API from the call stack, seen from a real ``get_optimizer_state_dict`` (so that a torch release
that renames what they read fails here)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from fn.collectives.dcp import (
    PER_RANK,
    called_by_state_dict_api,
    initializing_optimizer_state,
    own_entries,
    rank_key,
)


def test_each_rank_reads_its_own_entries_only():
    state = {"shared": 1, PER_RANK: {rank_key(0): "zero's", rank_key(2): "two's"}}
    assert (rank_key(0), rank_key(13)) == ("rank0", "rank13")
    assert rank_key() == "rank0"  # without torch.distributed: rank 0
    assert own_entries(state) == "zero's" and own_entries(state, 2) == "two's"
    assert own_entries(state, 1) is None  # saved on other ranks
    assert own_entries({"shared": 1}) is None and own_entries({PER_RANK: None}) is None
    assert own_entries({"rank0": "top level"}) is None  # only under "per_rank"


class _Recording(torch.optim.SGD):
    """SGD that records, at each read of ``state`` and each ``step()``, what fn reads of the
    stack."""

    def __init__(self, params: Any) -> None:
        self.reads: list[bool] = []
        self.steps: list[bool] = []
        super().__init__(params, lr=0.1)

    @property
    def state(self) -> Any:
        self.reads.append(called_by_state_dict_api())
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        self._state = value

    def step(self, closure: Any = None) -> Any:
        self.steps.append(initializing_optimizer_state())
        return super().step(closure)


def test_the_state_dict_api_and_its_initial_step_are_told_apart_from_a_users_calls():
    model = torch.nn.Linear(2, 1)
    opt = _Recording(model.parameters())
    del opt.reads[:]
    opt.state  # noqa: B018 (a user's read)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # a user's step
    assert opt.reads == [False] and opt.steps == [False]
    other = torch.nn.Linear(2, 1)
    stateless = _Recording(other.parameters())  # no state yet: DCP's API makes one
    del stateless.reads[:]
    get_optimizer_state_dict(other, stateless)
    assert stateless.reads and stateless.reads[0] is True  # DCP's API reads it first
    assert stateless.steps == [True]  # its zero-gradient step to create the state


def test_a_function_called_from_another_module_is_not_the_state_dict_api():
    def asks() -> bool:
        return called_by_state_dict_api()

    namespace = {"__name__": "torch.distributed.checkpoint.state_dict", "asks": asks}
    exec("def api():\n    return asks()", namespace)  # a frame of that module's name
    assert namespace["api"]() is True
    assert asks() is False
