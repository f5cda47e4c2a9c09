"""fn.fsdp.OnebitAdam's state names params without the segments that module wrappers add
(activation checkpointing's ``_checkpoint_wrapped_module``, torch.compile's ``_orig_mod``): a job
resumed with activation checkpointing turned on or off reads its checkpoint and continues bit for
bit (it was refused as "another model"), and a checkpoint saved before, which names them as the
model did, still loads into the model it was saved from, on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import fn.fsdp
from fn.collectives.agreement import digest
from fn.fsdp.onebit_layout import canonical_name
from tests._distributed import run_distributed
from tests.fsdp.test_onebit import WORLD, Net, batch

FREEZE, SAVED_AT, STEPS = 2, 3, 5  # saved in the compressed phase, two steps after it


def _build(wrapped: bool) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    if wrapped:
        model.block = checkpoint_wrapper(model.block)
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model: nn.Module, opt: fn.fsdp.OnebitAdam, rank: int, t: int) -> None:
    opt.zero_grad()
    x, y = batch(rank, t)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {canonical_name(n): p.full_tensor() for n, p in model.named_parameters()}


def _as_saved_before(opt: fn.fsdp.OnebitAdam, model: nn.Module) -> dict:
    """``opt``'s state dict as fn saved it before canonical names: keyed by the model's FQNs,
    its header's layout digest over them (the formula of that format)."""
    full = {canonical_name(n): n for n, m in model.named_modules() if isinstance(m, FSDPModule)}
    full |= {canonical_name(n): n for n, _ in model.named_parameters()}

    def renamed(tree):
        if not isinstance(tree, dict):
            return tree
        return {full.get(k, k): renamed(v) for k, v in tree.items()}

    state = renamed(opt.state_dict())
    layouts = [module.layout for module in opt._modules]
    header = state["header"].clone()
    header[3] = digest(
        repr([
            (full.get(x.name, x.name),
             [(full[s.name], tuple(s.param.shape)) for s in x.slots])
            for x in layouts
        ])
    )  # fmt: skip
    return {**state, "header": header}


def _worker(rank: int, world_size: int, root: str) -> dict:
    runs = {}
    for wrapped in (True, False):
        model = _build(wrapped)
        opt = fn.fsdp.OnebitAdam(model, lr=1e-2, freeze_step=FREEZE)
        for t in range(1, SAVED_AT + 1):
            _step(model, opt, rank, t)
        runs[wrapped] = model, opt
    wrapped_model, wrapped_opt = runs[True]
    keys = sorted(wrapped_opt.state_dict()["exp_avg"])
    path = f"{root}/now"
    dcp.save({"optim": wrapped_opt.state_dict()}, checkpoint_id=path)
    before = f"{root}/before"
    dcp.save({"optim": _as_saved_before(wrapped_opt, wrapped_model)}, checkpoint_id=before)
    shards = {canonical_name(n): p.to_local().clone() for n, p in wrapped_model.named_parameters()}
    for t in range(SAVED_AT + 1, STEPS + 1):
        _step(wrapped_model, wrapped_opt, rank, t)
    out = {"keys": keys, "straight": _params(wrapped_model), "resumed": {}}
    # resumed with activation checkpointing on (as saved) and off, and from the older format
    resumes = [("on", True, path), ("off", False, path)]
    resumes += [("before", True, before), ("before, off", False, before)]
    for name, wrapped, source in resumes:
        model = _build(wrapped)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.to_local().copy_(shards[canonical_name(n)])
        opt = fn.fsdp.OnebitAdam(model, lr=1e-2, freeze_step=FREEZE)
        try:
            opt.load_state_dict(fn.fsdp.read_onebit_state(opt, source, "optim"))
        except ValueError as err:
            out["resumed"][name] = str(err)
            continue
        for t in range(SAVED_AT + 1, STEPS + 1):
            _step(model, opt, rank, t)
        out["resumed"][name] = _params(model)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_resume_with_activation_checkpointing_toggled_continues_bit_for_bit(tmp_path):
    for result in run_distributed(_worker, WORLD, str(tmp_path), timeout=240):
        assert result["keys"] == ["block.bias", "block.weight", "head.bias", "head.weight", "scale"]
        for name in ("on", "off", "before"):
            resumed = result["resumed"][name]
            assert not isinstance(resumed, str), (name, resumed)
            assert resumed.keys() == result["straight"].keys()
            for k, v in result["straight"].items():
                assert torch.equal(resumed[k], v), (name, k)
        # the older format named the wrapper: it reads into the model it was saved from only
        assert "another model" in result["resumed"]["before, off"]
