"""exp_avg_mask="auto" on fn.fsdp.OnebitAdam and fn.fsdp.OnebitLamb, 2 gloo ranks, on a model
whose averaged gradients are exactly 0 at known elements in every update (embedding rows never
indexed, a dead ReLU unit): params and optimizer state equal, bit for bit, a run with those
elements masked by hand (fixed and automatic freeze); the mask is those elements' and changes
the run. Its DCP checkpoints resume bit for bit before, at and after the freeze (the records
also through a plain DCP Stateful), another world size gets the same mask, and a checkpoint
with "auto" is refused by an optimizer without it, and the reverse, with nothing loaded."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

import fn
import fn.fsdp
from fn import kernels
from fn.fsdp.loco import ROOT
from tests._distributed import run_together
from tests.fsdp import test_onebit
from tests.fsdp.test_onebit import WORLD, full_params, mask_bits, records
from tests.fsdp.test_onebit_checkpoint import KINDS, _refused

FREEZE, STEPS = 4, 7
SAVES = (1, FREEZE - 1, FREEZE, FREEZE + 2)  # warmup, before the freeze, at it, compressed
AUTO_FREEZE = fn.AutoFreeze(min_updates=2, max_updates=5, tolerance=0.95)  # switch at 3 to 6
USED_ROWS = (0, 2, 3, 4)  # of the embedding's 7
ONCE = 5  # the row also indexed at update 1: zero at the later updates, but kept


class Sparse(nn.Module):
    """``embed`` (7 rows: rank 1 holds rows 4 to 6 and a padded row) is indexed at
    ``USED_ROWS`` (and ``ONCE`` at update 1) only; ``block``'s unit 3 is dead (a bias of -100
    under the ReLU), so its weights and ``head``'s column 3 get no gradient; ``gate`` has one
    element, of which rank 1 holds none. ``block`` is an FSDP2 module of its own, the rest the
    root's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3)
        self.block = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)
        self.gate = nn.Parameter(torch.full((1,), 1.5))
        with torch.no_grad():
            self.block.bias[3] = -100.0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.block(self.embed(tokens).mean(1)))
        return self.head(hidden) * self.gate


def hand_masks() -> dict[str, torch.Tensor]:
    """The elements whose averaged gradient is exactly 0 at every update, by construction."""
    rows = torch.ones(7, 1)
    rows[[r for r in range(7) if r not in (*USED_ROWS, ONCE)]] = 0.0
    dead = torch.tensor([1.0, 1.0, 1.0, 0.0])
    return {
        "embed.weight": rows,
        "block.weight": dead[:, None],
        "block.bias": dead,
        "head.weight": dead[None, :],
    }


def build(seed: int = 0, world: int = WORLD) -> nn.Module:
    return test_onebit.build(seed=seed, world=world, net=Sparse)


def optimizer(
    kind: str, model: nn.Module, mask: str | None = "auto", freeze_step=FREEZE
) -> fn.fsdp.ShardedOnebitOptimizer:
    """``mask``: ``"auto"``, ``"hand"`` (:func:`hand_masks`), ``"used"`` (those and the used
    embedding row 0) or ``None``."""
    if mask in ("hand", "used"):
        masks = hand_masks()
        masks["embed.weight"][0] = 0.0 if mask == "used" else 1.0
        mask = {p: masks[k] for k, p in model.named_parameters() if k in masks}
    return KINDS[kind][0](
        model,
        lr=1e-2,
        freeze_step=freeze_step,
        betas=(0.9, 0.99),
        weight_decay=0.1,
        exp_avg_mask=mask,
    )


def train_step(model: nn.Module, opt: fn.fsdp.ShardedOnebitOptimizer, rank: int, t: int) -> None:
    opt.param_groups[0]["lr"] = 1e-2 / t
    opt.zero_grad()
    g = torch.Generator().manual_seed(100 * t + rank)
    tokens = torch.tensor(USED_ROWS)[torch.randint(len(USED_ROWS), (4, 3), generator=g)]
    if t == 1:
        tokens[0, 0] = ONCE
    nn.functional.mse_loss(model(tokens), torch.randn(4, 2, generator=g)).backward()
    opt.step()


def snapshot(opt: fn.fsdp.ShardedOnebitOptimizer) -> dict[str, torch.Tensor]:
    """The optimizer's state dict, flat, DTensors gathered (collective)."""
    flat = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = value.full_tensor() if isinstance(value, DTensor) else value.clone()

    walk("", opt.state_dict())
    return flat


def run(
    kind: str,
    rank: int,
    mask: str | None,
    freeze_step=FREEZE,
    root: str = "",
    saves=(),
    world: int = WORLD,
) -> dict:
    """``STEPS`` updates on ``world`` ranks, a checkpoint after each of ``saves`` under
    ``root``: the params and the state after each, the masks' bits, and the first compressed
    update."""
    model = build(world=world)
    opt = optimizer(kind, model, mask, freeze_step)
    params, states = {}, {}
    for t in range(1, STEPS + 1):
        train_step(model, opt, rank, t)
        params[t], states[t] = full_params(model), snapshot(opt)
        if t in saves:
            fn.fsdp.TrainingCheckpoint(model, opt, step=t).save(os.path.join(root, str(t)))
    switch = int(opt._state.auto.freeze_at) if opt._state.auto is not None else freeze_step
    return dict(params=params, states=states, masks=mask_bits(opt), switch=switch)


def kept(masks: dict[str, torch.Tensor]) -> int:
    """How many positions of the modules' ``X`` the masks (bits) keep."""
    return sum(int((kernels.unpackbits(b, 8 * b.numel()) > 0).sum()) for b in masks.values())


def _worker_equal(rank: int, world_size: int, kind: str) -> dict:
    runs = {
        (mask, str(freeze)): run(kind, rank, mask, freeze)
        for mask in ("auto", "hand")
        for freeze in (FREEZE, AUTO_FREEZE)
    }
    return dict(runs=runs, plain=run(kind, rank, None)["params"][STEPS])


@pytest.mark.timeout(660)
@pytest.mark.parametrize("kind", list(KINDS))
def test_auto_mask_equals_the_hand_mask_bit_for_bit(kind, launched):
    results = launched[f"equal {kind}"]
    shapes = {k: p.shape for k, p in Sparse().named_parameters()}
    masks = hand_masks()
    masked = sum(int((m.broadcast_to(shapes[k]) == 0).sum()) for k, m in masks.items())
    assert masked == 2 * 3 + 3 + 1 + 2
    for rank, result in enumerate(results):
        runs = result["runs"]
        for freeze in (str(FREEZE), str(AUTO_FREEZE)):
            auto, hand = runs[("auto", freeze)], runs[("hand", freeze)]
            assert auto["switch"] == hand["switch"] < STEPS, (freeze, auto["switch"])
            for name, bits in hand["masks"].items():  # the same bits as the hand mask's
                assert torch.equal(auto["masks"][name], bits), (rank, freeze, name)
            # every element but the masked ones kept, no padding position: not all ones
            assert kept(auto["masks"]) == sum(s.numel() for s in shapes.values()) - masked
            for t in range(1, STEPS + 1):
                for k, value in hand["params"][t].items():
                    assert torch.equal(auto["params"][t][k], value), (rank, freeze, t, k)
                assert auto["states"][t].keys() - hand["states"][t].keys() == {
                    f"{f}.{m}" for f in ("always_zero", "exp_avg_mask") for m in ("block", ROOT)
                }
                for k, value in hand["states"][t].items():
                    if k != "header":
                        assert torch.equal(auto["states"][t][k], value), (rank, freeze, t, k)
                header, hand_header = auto["states"][t]["header"], hand["states"][t]["header"]
                assert torch.equal(header[:4], hand_header[:4])
                assert header[4] != hand_header[4]  # the settings checksum tells "auto" apart
        auto = runs[("auto", str(FREEZE))]
        assert not torch.equal(auto["params"][STEPS]["head.weight"], result["plain"]["head.weight"])
        first = results[0]["runs"][("auto", str(FREEZE))]
        for k, value in auto["params"][STEPS].items():  # the ranks agree
            assert torch.equal(value, first["params"][STEPS][k]), (rank, k)
        for k in auto["states"][STEPS]:
            if k.startswith("exp_avg_mask."):  # the full masks too
                assert torch.equal(auto["states"][STEPS][k], first["states"][STEPS][k]), k


def _worker_save(rank: int, world_size: int, root: str, kind: str) -> dict:
    runs = {"fixed": ("auto", FREEZE, SAVES), "decided": ("auto", AUTO_FREEZE, range(1, STEPS))}
    runs.update(plain=(None, FREEZE, (1,)), hand=("hand", FREEZE, (1,)))
    out = {
        name: run(kind, rank, mask, freeze, os.path.join(root, name), saves)
        for name, (mask, freeze, saves) in runs.items()
    }
    model = build()  # the records through the optimizer as a plain DCP Stateful
    opt = optimizer(kind, model)
    for t in range(1, FREEZE):
        train_step(model, opt, rank, t)
    state = {"model": get_model_state_dict(model), "optim": opt}
    dcp.save(state, checkpoint_id=os.path.join(root, "stateful"))
    return out


def _resumed(kind: str, rank: int, path: str, freeze_step, start: int, expected: dict) -> list:
    """Loads the checkpoint of update ``start`` into a fresh optimizer and trains on: where the
    params or the state differ from ``expected`` (a run of :func:`run`)."""
    model = build(seed=1)  # other weights: the load must overwrite them
    opt = optimizer(kind, model, "auto", freeze_step)
    if path.endswith("stateful"):
        state = {"model": get_model_state_dict(model), "optim": opt}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
    else:
        fn.fsdp.TrainingCheckpoint(model, opt).load(path)
    mismatches = []
    for t in range(start, STEPS + 1):
        if t > start:
            train_step(model, opt, rank, t)
        got = {**full_params(model), **snapshot(opt)}
        want = {**expected["params"][t], **expected["states"][t]}
        keys = got.keys() | want.keys()
        mismatches += [
            (start, t, k)
            for k in sorted(keys)
            if k not in got or k not in want or not torch.equal(got[k], want[k])
        ]
    return mismatches


def _worker_resume(rank: int, world_size: int, root: str, kind: str, saved: list) -> dict:
    fixed, decided = saved[rank]["fixed"], saved[rank]["decided"]  # with this rank's errors
    mismatches = []
    for start in SAVES:
        path = os.path.join(root, "fixed", str(start))
        mismatches += _resumed(kind, rank, path, FREEZE, start, fixed)
    stateful = os.path.join(root, "stateful")
    mismatches += _resumed(kind, rank, stateful, FREEZE, FREEZE - 1, fixed)
    for start in (decided["switch"] - 1, decided["switch"]):  # the update that decided, the switch
        path = os.path.join(root, "decided", str(start))
        mismatches += _resumed(kind, rank, path, AUTO_FREEZE, start, decided)
    refusals = {}
    for made, into in (("fixed", None), ("fixed", "hand"), ("plain", "auto"), ("hand", "auto")):
        model = build(seed=1)
        opt = optimizer(kind, model, into)
        saved = records(opt)
        refusals[(made, into)] = _refused(model, opt, os.path.join(root, made, "1"))
        if saved is not None:  # nothing loaded into the records either
            assert all(torch.equal(records(opt)[k], x) for k, x in saved.items())
    return dict(mismatches=mismatches, refusals=refusals)


def _worker_other_world_size(rank: int, world_size: int, root: str, kind: str) -> dict:
    hand = mask_bits(optimizer(kind, build(world=world_size), "hand"))
    out = {}
    for start in (FREEZE - 1, FREEZE + 2):
        model = build(seed=1, world=world_size)
        opt = optimizer(kind, model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the error feedback restarts
            fn.fsdp.TrainingCheckpoint(model, opt).load(os.path.join(root, "fixed", str(start)))
            loaded = (mask_bits(opt), records(opt))
            for t in range(start + 1, STEPS + 1):
                train_step(model, opt, rank, t)
        out[start] = dict(loaded=loaded, trained=mask_bits(opt))
    return dict(out=out, hand=hand)


@pytest.mark.timeout(660)
@pytest.mark.parametrize("kind", list(KINDS))
def test_auto_mask_resumes_bit_for_bit_and_mismatches_are_refused(kind, launched):
    saved = launched[f"save {kind}"]
    switch = saved[0]["decided"]["switch"]
    assert 3 <= switch < STEPS and all(r["decided"]["switch"] == switch for r in saved)
    results = launched[f"resume {kind}"]
    for rank, result in enumerate(results):
        assert result["mismatches"] == [], (rank, result["mismatches"][:5])
        for case, (message, unchanged) in result["refusals"].items():
            assert message.startswith("ValueError") and "exp_avg_mask" in message, (case, message)
            assert '"auto"' in message and "nothing was loaded" in message, message
            assert unchanged, case
    (one,) = launched[f"other_world_size {kind}"]
    hand = one["hand"]
    before, after = one["out"][FREEZE - 1], one["out"][FREEZE + 2]
    assert set(hand) == set(after["loaded"][0])
    for name, bits in hand.items():
        assert before["loaded"][0][name] is None  # the records, laid out for one rank
        assert torch.equal(before["loaded"][1][name], bits.bitwise_not()), name
        assert torch.equal(before["trained"][name], bits), name  # the freeze at one rank
        assert torch.equal(after["loaded"][0][name], bits) and after["loaded"][1] is None
        assert torch.equal(after["trained"][name], bits), name


def _worker_runs_by_mask(rank: int, world_size: int, kind: str) -> dict:
    """Per mask (``"auto"``, ``"hand"``, ``"used"``, ``None``): the final params and the
    run's ``RuntimeWarning``s."""
    out = {}
    for mask in ("auto", "hand", "used", None):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            params = run(kind, rank, mask, world=world_size)["params"][STEPS]
        runtime = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        out[str(mask)] = dict(params=params, warnings=runtime)
    return out


@pytest.mark.timeout(660)
@pytest.mark.parametrize("world", [1, WORLD])
@pytest.mark.parametrize("kind", list(KINDS))
def test_masks_apply_at_every_world_size_and_masked_zero_variance_is_no_alarm(
    kind, world, launched
):
    """At one rank, where no reduce-scatter runs, the rule itself applies the masks: the
    automatic one equals the hand-made one, and masking a used row changes that row. At the
    freeze the variance's exact zeros under the mask raise no warning; without it they do."""
    results = launched[f"runs_by_mask {kind} {world}"]
    for result in results:
        auto, hand, used, plain = (result[k] for k in ("auto", "hand", "used", "None"))
        for k, value in hand["params"].items():
            assert torch.equal(auto["params"][k], value), k
        rows = hand["params"]["embed.weight"], used["params"]["embed.weight"]
        assert not torch.equal(rows[0][0], rows[1][0])
        assert auto["warnings"] == hand["warnings"] == []
        assert any("elements at zero" in m for m in plain["warnings"]), plain["warnings"]


def _worker_failed_freeze(rank: int, world_size: int, root: str, kind: str) -> dict:
    """The freeze update refused (a non-finite gradient on rank 0), a checkpoint saved then and
    loaded into a new optimizer, which trains on: the records it loaded and its mask."""
    model = build()
    opt = optimizer(kind, model)
    for t in range(1, FREEZE):
        train_step(model, opt, rank, t)
    before = records(opt)
    opt.zero_grad()
    tokens = torch.tensor([USED_ROWS[:3]] * 4)
    scale = float("inf") if rank == 0 else 1.0
    (model(tokens).square().mean() * scale).backward()
    with pytest.raises(fn.NonFiniteError):
        opt.step()
    path = os.path.join(root, "failed")
    fn.fsdp.TrainingCheckpoint(model, opt, step=FREEZE - 1).save(path)
    resumed = build(seed=1)
    opt = optimizer(kind, resumed)
    fn.fsdp.TrainingCheckpoint(resumed, opt).load(path)
    loaded = records(opt)
    for t in range(FREEZE, STEPS + 1):
        train_step(resumed, opt, rank, t)
    hand = mask_bits(optimizer(kind, build(), "hand"))
    return dict(records=before, loaded=loaded, masks=mask_bits(opt), hand=hand)


@pytest.mark.timeout(660)
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_refused_freeze_keeps_the_records(kind, launched):
    """A freeze update that raises keeps the warmup's records: a checkpoint taken then resumes
    them, and the freeze after it builds the hand-made mask."""
    results = launched[f"failed_freeze {kind}"]
    for result in results:
        for name, bits in result["records"].items():
            assert torch.equal(result["loaded"][name], bits), name
        for name, bits in result["hand"].items():
            assert torch.equal(result["masks"][name], bits), name


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``{"WORKER KIND[ WORLD]": results by rank}`` of every worker above, in three launches
    (each worker builds its own model and leaves the group usable): the runs on WORLD ranks
    (the refused freeze last), the resumes of their checkpoints, and the runs on one rank."""
    saves = {kind: str(tmp_path_factory.mktemp(f"saves-{kind}")) for kind in KINDS}
    first = {}
    for kind in KINDS:
        first[f"equal {kind}"] = (_worker_equal, (kind,))
        first[f"save {kind}"] = (_worker_save, (saves[kind], kind))
        first[f"runs_by_mask {kind} {WORLD}"] = (_worker_runs_by_mask, (kind,))
    for kind in KINDS:
        failed = str(tmp_path_factory.mktemp(f"failed-{kind}"))
        first[f"failed_freeze {kind}"] = (_worker_failed_freeze, (failed, kind))
    out = run_together(first, WORLD, timeout=600)
    resumes = {
        f"resume {kind}": (_worker_resume, (saves[kind], kind, out[f"save {kind}"]))
        for kind in KINDS
    }
    out.update(run_together(resumes, WORLD, timeout=600))
    one = {}
    for kind in KINDS:
        one[f"other_world_size {kind}"] = (_worker_other_world_size, (saves[kind], kind))
        one[f"runs_by_mask {kind} 1"] = (_worker_runs_by_mask, (kind,))
    out.update(run_together(one, 1, timeout=600))
    return out
