"""What the training stacks do to an fn-managed model: storage replacement (``model.to("cpu:0")``),
safetensors saving and loading, a ``torchrun`` environment without a process group, and
checkpoints that rank 0 saves alone (per-rank error feedback, on 2 gloo processes)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fn
import fn.optim
from fn.collectives import Local
from tests._distributed import run_distributed
from tests.optim._problem import backward, flat_params, make_model, save_and_load, train

STEPS, FREEZE = 8, 3


def _onebit_adam(params):
    return fn.optim.OnebitAdam(params, lr=1e-2, freeze_step=FREEZE, weight_decay=0.01, comm=Local())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("replace", ["to-cpu:0", "data-clone"])
def test_replaced_storage_is_re_adopted_bit_for_bit(replace, dtype):
    model = make_model(dtype=dtype)
    opt = _onebit_adam(model.parameters())
    _, reference = train(model, opt, 0, range(STEPS))

    model = make_model(dtype=dtype)
    opt = _onebit_adam(model.parameters())
    train(model, opt, 0, range(2))
    before = [p.data_ptr() for p in model.parameters()]
    if replace == "to-cpu:0":
        model.to("cpu:0")
    else:
        for p in model.parameters():
            p.data = p.detach().clone()
    assert all(p.data_ptr() != b for p, b in zip(model.parameters(), before, strict=True))
    _, history = train(model, opt, 0, range(2, STEPS))
    assert torch.equal(history[-1], reference[-1])
    # re-adopted: the params alias the optimizer's buffer again
    assert [p.data_ptr() for p in model.parameters()] == before


def test_a_replaced_param_brings_its_new_values():
    model = make_model()
    opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.sgd(0.5), comm=Local())
    weight = model[0].weight
    weight.data = torch.full_like(weight, 2.0)
    backward(model, 0, 0)
    grad = weight.grad.clone()
    opt.step()
    assert torch.equal(weight.detach(), torch.full_like(weight, 2.0) - 0.5 * grad)
    assert torch.equal(opt._groups[0].flat.model[: weight.numel()], weight.detach().reshape(-1))


@pytest.mark.parametrize("move", ["dtype", "shape"])
def test_a_real_move_is_a_clear_error_and_changes_nothing(move):
    model = make_model()
    opt = _onebit_adam(model.parameters())
    train(model, opt, 0, range(2))
    state = save_and_load(opt.state_dict())
    if move == "dtype":
        model.double()
        match = "moved to cpu, torch.float64 after the optimizer was built.*before building"
    else:
        model[2].bias.data = torch.zeros(4)
        match = "changed shape from \\(3,\\) to \\(4,\\)"
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    with pytest.raises(RuntimeError, match=match):
        opt.state_dict()
    assert opt._groups[0].step == state["state"][0]["step"] == 2


def test_params_get_storages_of_their_own_on_the_buffer():
    model = make_model()
    opt = _onebit_adam(model.parameters())
    buffer = opt._groups[0].flat.model
    offset = 0
    for p in model.parameters():
        storage = p.untyped_storage()
        assert storage.data_ptr() == p.data_ptr() == buffer[offset:].data_ptr()
        assert storage.nbytes() == p.numel() * p.element_size()
        offset += p.numel()


def test_safetensors_save_and_load_model(tmp_path):
    safetensors_torch = pytest.importorskip(
        "safetensors.torch", reason="safetensors is in the 'integrations' extra"
    )
    model = make_model()
    opt = _onebit_adam(model.parameters())
    train(model, opt, 0, range(STEPS))
    safetensors_torch.save_model(model, tmp_path / "model.safetensors")
    saved = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert saved.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(saved[name], tensor), name

    other = make_model(seed=1)
    other_opt = _onebit_adam(other.parameters())
    ptrs = [p.data_ptr() for p in other.parameters()]
    safetensors_torch.load_model(other, tmp_path / "model.safetensors")
    assert [p.data_ptr() for p in other.parameters()] == ptrs  # loaded into the buffer
    assert torch.equal(flat_params(other), flat_params(model))
    assert torch.equal(other_opt._groups[0].flat.model, flat_params(model))


def test_world_size_without_a_process_group_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 .* not initialized.*init_process_group"):
        fn.optim.OnebitAdam(make_model().parameters(), freeze_step=2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert isinstance(fn.optim.OnebitAdam(make_model().parameters()).comm, Local)


def test_records_name_their_rank_and_old_records_still_load():
    model = make_model()
    opt = _onebit_adam(model.parameters())
    train(model, opt, 0, range(2))
    saved = opt.state_dict()
    assert saved["state"][0]["rank"] == 0
    del saved["state"][0]["rank"]
    opt.load_state_dict(saved)
    saved["state"][0]["rank"] = 1
    with pytest.raises(ValueError, match="'rank' 1 is not below its world_size 1"):
        opt.load_state_dict(saved)


# ---------------------------------------------------------------- two ranks, rank 0 saves alone


def _dist_onebit_adam(params):
    return fn.optim.OnebitAdam(params, lr=1e-2, freeze_step=FREEZE, weight_decay=0.01)


def _dcp_resume(rank, path):
    """An uninterrupted run and one saved at K with torch.distributed.checkpoint, loaded into a
    fresh model and optimizer and continued."""
    import torch.distributed.checkpoint as dcp

    k = STEPS - 3
    model = make_model(dtype=torch.bfloat16)
    opt = _dist_onebit_adam(model.parameters())
    _, full = train(model, opt, rank, range(STEPS))
    model = make_model(dtype=torch.bfloat16)
    opt = _dist_onebit_adam(model.parameters())
    train(model, opt, rank, range(k))
    # DCP holds the full layout (the momentum unpacked, every buffer allocated)
    full_state = opt._groups[0].transform.full_state
    before = fn.optim._checkpoint.state_to_dict(full_state(opt._groups[0].state))
    dcp.save({"model": model.state_dict(), "optim": fn.optim.PerRankState(opt)}, checkpoint_id=path)
    fresh = make_model(seed=1, dtype=torch.bfloat16)
    fresh_opt = _dist_onebit_adam(fresh.parameters())
    state = {"model": fresh.state_dict(), "optim": fn.optim.PerRankState(fresh_opt)}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    after = fresh_opt.state_dict()["state"][0]["functional"]
    same_state = before.keys() == after.keys() and all(
        before[key] is after[key] is None or torch.equal(before[key], after[key]) for key in before
    )
    _, resumed = train(fresh, fresh_opt, rank, range(k, STEPS))
    return {"same_state": same_state, "full": full[-1], "resumed": resumed[-1]}


def _rank0_checkpoints(rank, world_size, path):
    """Runs STEPS updates uninterrupted, and runs stopped at K where rank 0's state (gathered or
    not) is loaded on every rank, as Trainer and Accelerate do."""
    k = STEPS - 3
    model = make_model()
    opt = _dist_onebit_adam(model.parameters())
    _, full = train(model, opt, rank, range(STEPS))
    out = {"full": full[-1]}
    for gathered in (False, True):
        model = make_model()
        opt = _dist_onebit_adam(model.parameters())
        train(model, opt, rank, range(k))
        if gathered:
            opt.gather_error_feedback()
        mine = opt.state_dict()
        out[f"rank_recorded_{gathered}"] = mine["state"][0]["rank"]
        out[f"has_all_{gathered}"] = "error_feedback_by_rank" in mine["state"][0]
        objects = [save_and_load(mine) if rank == 0 else None]
        torch.distributed.broadcast_object_list(objects, src=0)
        fresh = make_model(seed=1)
        fresh.load_state_dict(model.state_dict())
        fresh_opt = _dist_onebit_adam(fresh.parameters())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fresh_opt.load_state_dict(objects[0])
        out[f"warnings_{gathered}"] = [str(w.message) for w in caught]
        error = fresh_opt.state_dict()["state"][0]["functional"]
        out[f"error_zero_{gathered}"] = all(
            v is None or not v.any() for key, v in error.items() if key.endswith("_error")
        )
        _, resumed = train(fresh, fresh_opt, rank, range(k, STEPS))
        out[f"resumed_{gathered}"] = resumed[-1]
    # the snapshot is dropped once stale: the next state_dict() holds this rank's only
    opt.gather_error_feedback()
    train(model, opt, rank, range(k, k + 1))
    out["stale_dropped"] = "error_feedback_by_rank" not in opt.state_dict()["state"][0]
    out["dcp"] = _dcp_resume(rank, path)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_rank0_only_and_dcp_checkpoints_keep_each_ranks_error_feedback(tmp_path):
    out = run_distributed(_rank0_checkpoints, 2, str(tmp_path / "dcp"), timeout=240)
    for rank in (0, 1):
        assert out[rank]["rank_recorded_False"] == rank
        assert out[rank]["has_all_True"] == (rank == 0)
        assert not out[rank]["has_all_False"]
        # gathered: every rank resumes bit for bit
        assert torch.equal(out[rank]["resumed_True"], out[rank]["full"])
        assert out[rank]["warnings_True"] == []
        assert out[rank]["stale_dropped"]
    # not gathered: rank 1 is warned and starts from zero error feedback (not rank 0's); the
    # ranks stay in lockstep
    assert out[0]["warnings_False"] == [] and not out[0]["error_zero_False"]
    (warning,) = out[1]["warnings_False"]
    assert "rank 1 loads the optimizer state of rank [0]" in warning and "reset to zero" in warning
    assert out[1]["error_zero_False"]
    assert torch.equal(out[0]["resumed_False"], out[1]["resumed_False"])
    # DCP: each rank gets its own error feedback back and resumes bit for bit
    for rank in (0, 1):
        assert out[rank]["dcp"]["same_state"]
        assert torch.equal(out[rank]["dcp"]["resumed"], out[rank]["dcp"]["full"])
