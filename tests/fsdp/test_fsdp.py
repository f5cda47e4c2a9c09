"""loco_reduce_scatter inside FSDP2 (fully_shard on gloo): gradients, layout changes, DCP resume,
and a failed save that leaves the previous checkpoint."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fn.fsdp import CheckpointWriteError, TrainingCheckpoint, loco_reduce_scatter
from tests._distributed import run_together


class Net(nn.Module):
    """Two sharded blocks of equal size (their error feedback must stay apart) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.block0 = nn.Linear(12, 12)
        self.block1 = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)
        self.spare = nn.Linear(12, 3)  # in the root's group; used only when asked

    def forward(self, x: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        h = torch.tanh(self.block1(torch.tanh(self.block0(x))))
        return self.head(h) + (self.spare(h) if use_spare else 0)


def build(
    world_size: int, seed: int = 0, divide_factor: float | None = None, force_sum: bool = False
) -> nn.Module:
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in (model.block0, model.block1):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if divide_factor is not None:
        model.set_gradient_divide_factor(divide_factor)  # a PREMUL_SUM op, or SUM then divide
    model.set_force_sum_reduction_for_comms(force_sum)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 12, generator=g), torch.randn(5, 3, generator=g)


def grads(model: nn.Module, rank: int, step: int = 0, use_spare: bool = True) -> dict:
    x, y = batch(rank, step)
    model.zero_grad()
    nn.functional.mse_loss(model(x, use_spare), y).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def train(model, optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x, use_spare=True), y).backward()
        optimizer.step()


def full_params(model: nn.Module) -> dict:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


CASES = ((None, False), (3.0, False), (None, True))


def _worker_grads(rank: int, world_size: int) -> dict:
    out = {}
    for factor, force_sum in CASES:  # ops AVG, PREMUL_SUM(1/3), SUM
        # gloo refuses PREMUL_SUM: the dense reference sums, then FSDP2 divides by the factor
        dense = grads(build(world_size, divide_factor=factor, force_sum=True), rank)
        model = build(world_size, divide_factor=factor, force_sum=force_sum)
        handle = loco_reduce_scatter(model, bits=8, group_size=4, err_beta=None)
        out["qgz", factor, force_sum] = dense, grads(model, rank), sorted(handle.reduce_scatters)

    model = build(world_size)
    handle = loco_reduce_scatter(model, bits=4, group_size=4, err_beta=0.8)
    grads(model, rank, 0)
    errors = {n: rs.errors[0].clone() for n, rs in handle.reduce_scatters.items()}
    out["separate"] = errors
    out["counts"] = {n: int(rs.count) for n, rs in handle.reduce_scatters.items()}

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("fn.fsdp.reduce_scatter").addHandler(handler)
    grads(model, rank, 1, use_spare=False)  # the spare layer has no gradient: a new layout
    logging.getLogger("fn.fsdp.reduce_scatter").removeHandler(handler)
    out["layout_log"] = [r.getMessage() for r in records]
    out["bytes"] = handle.bytes_sent

    saved = {k: v.clone() for k, v in handle.reduce_scatters["block1"].state_dict().items()}
    state = handle.state_dict()
    own = state["per_rank"][f"rank{rank}"]
    refused = []
    for broken, kind in (
        ({"per_rank": {"rank9": own}}, KeyError),
        ({f"rank{rank}": own}, KeyError),  # not under "per_rank"
        ({"per_rank": {f"rank{rank}": {"block0": own["block0"]}}}, KeyError),
        (
            {
                "per_rank": {
                    f"rank{rank}": {
                        **own,
                        "<root>": {**own["<root>"], "error.0": torch.zeros(3)},
                    }
                }
            },
            ValueError,
        ),
    ):
        try:
            handle.load_state_dict(broken)
        except kind as err:
            refused.append(str(err))
    after = handle.reduce_scatters["block1"].state_dict()
    out["refused"] = refused, all(torch.equal(saved[k], after[k]) for k in saved)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, tuple[list, Path]]:
    """The workers of this file on the same 2 ranks, in one launch, each with a folder of its
    own: ``{name: (results by rank, folder)}``."""
    workers = {
        "grads": (_worker_grads, False),
        "resume": (_worker_resume, True),
        "interrupted save": (_worker_interrupted_save, True),
    }
    folders = {name: tmp_path_factory.mktemp(name.replace(" ", "_")) for name in workers}
    parts = {
        name: (worker, (str(folders[name] / "ckpt"),) if takes_path else ())
        for name, (worker, takes_path) in workers.items()
    }
    results = run_together(parts, 2, timeout=500)
    return {name: (results[name], folders[name]) for name in workers}


@pytest.fixture(scope="module")
def grad_results(two_ranks):
    return two_ranks["grads"][0]


@pytest.mark.timeout(600)
def test_qgz_gradients_within_quantization_error_of_dense(grad_results):
    for factor, force_sum in CASES:
        for rank in range(2):
            dense, quantized, names = grad_results[rank]["qgz", factor, force_sum]
            assert names == ["<root>", "block0", "block1"]
            assert dense.keys() == quantized.keys()
            for name, want in dense.items():
                # 8 bits: a value moves by at most its group's absmax / 128 per rank; the ranks'
                # gradients here are within 3x of the reduced one's size
                bound = 3 * float(want.abs().max()) * 2 / 128 + 1e-7
                err = float((quantized[name] - want).abs().max())
                assert err <= bound, (factor, name, err, bound)
            # the divide factor 3 (a PREMUL_SUM op) scales the sum by 1/3: 2/3 of the mean
            if factor is not None:
                mean = grad_results[rank]["qgz", None, False][0]["head.bias"]
                torch.testing.assert_close(dense["head.bias"], mean * 2 / 3)


@pytest.mark.timeout(600)
def test_equal_modules_keep_their_own_error_and_ranks_agree(grad_results):
    for rank in range(2):
        errors = grad_results[rank]["separate"]
        assert errors["block0"].shape == errors["block1"].shape
        assert not torch.equal(errors["block0"], errors["block1"])
        assert grad_results[rank]["counts"] == grad_results[0]["counts"]
        assert grad_results[rank]["bytes"] > 0
    assert not torch.equal(
        grad_results[0]["separate"]["block0"], grad_results[1]["separate"]["block0"]
    )


@pytest.mark.timeout(600)
def test_load_state_dict_refuses_other_ranks_models_and_shapes(grad_results):
    for rank in range(2):
        refused, unchanged = grad_results[rank]["refused"]
        assert len(refused) == 4 and unchanged
        assert all(f"rank{rank}" in message for message in refused[:2]), refused
        assert "block1" in refused[2] and "error.0" in refused[3]


@pytest.mark.timeout(600)
def test_layout_change_in_fsdp_logs_and_continues(grad_results):
    for rank in range(2):
        messages = grad_results[rank]["layout_log"]
        assert len(messages) == 1 and "<root>" in messages[0] and "reset" in messages[0]


def _worker_resume(rank: int, world_size: int, path: str) -> dict:
    def setup(seed):
        model = build(world_size, seed=seed)
        handle = loco_reduce_scatter(model, bits=4, group_size=4, err_beta=0.8, reset_T=3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, optimizer, handle

    model, optimizer, handle = setup(0)
    train(model, optimizer, rank, range(5))
    straight = full_params(model), handle.state_dict()

    model, optimizer, handle = setup(0)
    train(model, optimizer, rank, range(2))
    TrainingCheckpoint(model, optimizer, handle, step=2).save(path)

    model, optimizer, handle = setup(1)  # other weights: the checkpoint must bring all back
    checkpoint = TrainingCheckpoint(model, optimizer, handle)
    checkpoint.load(path)
    train(model, optimizer, rank, range(checkpoint.step, 5))
    return straight, (full_params(model), handle.state_dict()), checkpoint.step


@pytest.mark.timeout(600)
def test_dcp_resume_is_bit_identical(two_ranks):
    results, _ = two_ranks["resume"]
    for rank, ((params, loco), (resumed_params, resumed_loco), step) in enumerate(results):
        assert step == 2
        assert list(loco) == ["per_rank"] and list(loco["per_rank"]) == [f"rank{rank}"]
        own, resumed_own = loco["per_rank"][f"rank{rank}"], resumed_loco["per_rank"][f"rank{rank}"]
        for name, value in params.items():
            assert torch.equal(value, resumed_params[name]), name
        for module, state in own.items():
            for key, value in state.items():
                assert torch.equal(value, resumed_own[module][key]), (module, key)
        assert int(own["block0"]["count"]) == 5
    assert not torch.equal(
        results[0][0][1]["per_rank"]["rank0"]["block0"]["error.0"],
        results[1][0][1]["per_rank"]["rank1"]["block0"]["error.0"],
    )


def _worker_interrupted_save(rank: int, world_size: int, path: str) -> dict:
    model = build(world_size, seed=0)
    handle = loco_reduce_scatter(model, bits=4, group_size=4, err_beta=0.8, reset_T=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, rank, range(2))
    TrainingCheckpoint(model, optimizer, handle, step=2).save(path)
    saved = full_params(model)
    train(model, optimizer, rank, range(2, 4))
    # the data written, the metadata not: DCP's last act fails
    with mock.patch.object(FileSystemWriter, "finish", side_effect=OSError("disk full")):
        with pytest.raises(
            CheckpointWriteError, match=r"rank\(s\) \[0\] failed: OSError: disk full"
        ):
            TrainingCheckpoint(model, optimizer, handle, step=4).save(path)
    checkpoint = TrainingCheckpoint(model, optimizer, handle)
    checkpoint.load(path)
    kept = checkpoint.step, full_params(model)
    train(model, optimizer, rank, range(2, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TrainingCheckpoint(model, optimizer, handle, step=4).save(path)
    checkpoint.load(path)
    return dict(saved=saved, kept=kept, replaced=checkpoint.step, warnings=len(caught))


@pytest.mark.timeout(600)
def test_a_failed_save_keeps_the_previous_checkpoint(two_ranks):
    results, tmp_path = two_ranks["interrupted save"]
    for result in results:
        step, params = result["kept"]
        assert step == 2
        for name, value in result["saved"].items():
            assert torch.equal(params[name], value), name
        assert result["replaced"] == 4 and result["warnings"] == 0
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
