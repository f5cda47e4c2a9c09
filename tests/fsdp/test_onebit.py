"""fn.fsdp.OnebitAdam on 2 gloo ranks: bit for bit against a loop-over-ranks reference of the rule
in docs/algorithms.md ("1-bit Adam and 1-bit LAMB on FSDP2"), written here, also with two modules
in one FSDP2 group (``fully_shard([block, head])``, one vector X), and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import fn
import fn.fsdp
from tests._distributed import run_together

WORLD = 2
LR, FREEZE, BETAS, EPS = 1e-2, 3, (0.9, 0.999), 1e-8
STEPS = 7


class Net(nn.Module):
    """``block`` is sharded on its own (a weight of 3 rows: dim-0 padding at W = 2, and a row of
    12 padded to 16); ``head`` and ``scale`` sit in the root's group, where FSDP2 puts the root's
    own ``scale`` after its child's params (registration order puts it first)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))
        self.block = nn.Linear(5, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(x))) * self.scale


MODULES = [["block.weight", "block.bias"], ["head.weight", "head.bias", "scale"]]  # FSDP2's order
# fully_shard([block, head]): one group (one X, block's params, then head's), the root's scale
GROUPED = [["block.weight", "block.bias", "head.weight", "head.bias"], ["scale"]]


def build(
    seed: int = 0,
    shard: bool = True,
    policy: MixedPrecisionPolicy | None = None,
    world: int = WORLD,
    net: type[nn.Module] = Net,
    grouped: bool = False,
):
    torch.manual_seed(seed)
    model = net()
    if shard:
        mesh = init_device_mesh("cpu", (world,))
        mp = {} if policy is None else {"mp_policy": policy}
        fully_shard([model.block, model.head] if grouped else model.block, mesh=mesh, **mp)
        fully_shard(model, mesh=mesh, **mp)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)


def lr_at(t: int) -> float:
    return LR if t < 6 else LR / 2  # a scheduler's change, read at every step


# ----------------------------------------------------------------------------- the reference


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    return v.double().sqrt().float()


def rms(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(math.sqrt(float(x.double().square().sum()) / x.numel()))


def sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


def row_layout(
    shapes: list[torch.Size], rows: int = WORLD, unit: int | None = None
) -> tuple[list[int], int]:
    """Each param's values per row (dim 0 padded to a multiple of ``rows``, the ranks of the
    shard group) and the row padded to a multiple of ``unit`` (default ``lcm(rows, 8)``)."""
    widths = [-(-s[0] // rows) * math.prod(s[1:]) for s in shapes]
    unit = math.lcm(rows, 8) if unit is None else unit
    return widths, -(-sum(widths) // unit) * unit


def to_x(tensors: list[torch.Tensor], rows: int = WORLD, unit: int | None = None) -> torch.Tensor:
    """FSDP2's layout, flat: row j holds rows [j R, (j + 1) R) of every tensor, zero padded
    (``rows`` and ``unit`` as :func:`row_layout`'s)."""
    widths, padded = row_layout([t.shape for t in tensors], rows, unit)
    x = torch.zeros(rows, padded)
    for j in range(rows):
        offset = 0
        for t, width in zip(tensors, widths, strict=True):
            per_rank = -(-t.shape[0] // rows)
            piece = t[j * per_rank : (j + 1) * per_rank].reshape(-1)
            x[j, offset : offset + piece.numel()] = piece
            offset += width
    return x.reshape(-1)


def from_x(
    x: torch.Tensor, like: list[torch.Tensor], rows: int = WORLD, unit: int | None = None
) -> list[torch.Tensor]:
    widths, padded = row_layout([t.shape for t in like], rows, unit)
    rows_of = x.view(rows, padded)
    out, offset = [], 0
    for t, width in zip(like, widths, strict=True):
        per_rank = -(-t.shape[0] // rows)
        per_row = math.prod(t.shape[1:])
        pieces = []
        for j in range(rows):
            real = max(0, min(per_rank, t.shape[0] - j * per_rank)) * per_row
            pieces.append(rows_of[j, offset : offset + real])
        out.append(torch.cat(pieces).view(t.shape))
        offset += width
    return out


def car(xs: list[torch.Tensor], ews: list[torch.Tensor], ess: list[torch.Tensor]) -> torch.Tensor:
    """The 1-bit allreduce of docs/algorithms.md over the ranks' ``xs`` (no padding: the length
    is a multiple of W lcm(W, 8)); updates the error lists."""
    n = xs[0].numel()
    chunk = n // WORLD
    scales, signs = [], []
    for r in range(WORLD):
        m = xs[r] + ews[r]
        a = rms(m)
        ews[r] = (m - a * sign(m)).to(ews[r].dtype)  # rounded once to the error dtype
        scales.append(a)
        signs.append(sign(m))
    out = []
    for r in range(WORLD):
        c = None
        for i in range(WORLD):
            term = signs[i][r * chunk : (r + 1) * chunk] * (scales[i] / WORLD)
            c = term if c is None else c + term
        c = c + ess[r]
        b = rms(c)
        ess[r] = (c - b * sign(c)).to(ess[r].dtype)
        out.append(b * sign(c))
    return torch.cat(out)


# exp_avg_mask: block.weight's middle row (dim-0 padding at W = 2: rank 0's second row) as a
# broadcast (3, 1) mask, and head.bias's first element
MASKS = {"block.weight": torch.tensor([[1.0], [0.0], [1.0]]), "head.bias": torch.tensor([0.0, 1.0])}


def masks_of(model: nn.Module) -> dict:
    return {p: MASKS[k] for k, p in model.named_parameters() if k in MASKS}


class Reference:
    def __init__(
        self,
        params: dict[str, torch.Tensor],
        weight_decay: float,
        masked: bool = False,
        error_dtype: str = "float32",
        modules: list[list[str]] = MODULES,
    ) -> None:
        self.modules = modules
        self.masks = MASKS if masked else {}
        self.error_dtype = getattr(torch, error_dtype)
        self.p = {k: v.clone() for k, v in params.items()}
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}
        self.wd = weight_decay
        b1, b2 = BETAS
        self.bound = (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))
        self.errors = {}

    def step(self, t: int, grads: list[dict[str, torch.Tensor]]) -> None:
        b1, b2 = BETAS
        if t < FREEZE:
            for k in self.p:
                g = (grads[0][k] + grads[1][k]) / WORLD
                self.m[k] = b1 * self.m[k] + (1 - b1) * g
                self.v[k] = b2 * self.v[k] + ((1 - b2) * g) * g
        else:
            for names in self.modules:
                like = [self.p[k] for k in names]
                previous = to_x([self.m[k] for k in names])  # zero at the padding
                xs = [b1 * previous + (1 - b1) * to_x([g[k] for k in names]) for g in grads]
                if names[0] not in self.errors:
                    dtype = self.error_dtype
                    self.errors[names[0]] = (
                        [torch.zeros_like(previous, dtype=dtype) for _ in range(WORLD)],
                        [torch.zeros(previous.numel() // WORLD, dtype=dtype) for _ in range(WORLD)],
                    )
                y = car(xs, *self.errors[names[0]])
                self.m.update(zip(names, from_x(y, like), strict=True))
                for k in names:
                    if k in self.masks:
                        self.m[k] = self.m[k] * self.masks[k]
        lr = torch.tensor(lr_at(t))
        for k in self.p:
            u = self.m[k] / (sqrt_rn(self.v[k]) + EPS)
            if t >= FREEZE:
                u = u.clamp(-self.bound, self.bound)
            if self.wd > 0:
                u = u + self.wd * self.p[k]
            self.p[k] = self.p[k] + u * -lr


def local_grads(params: dict[str, torch.Tensor], rank: int, step: int) -> dict[str, torch.Tensor]:
    model = build(shard=False)
    model.load_state_dict(params)
    x, y = batch(rank, step)
    nn.functional.mse_loss(model(x), y).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}


def held(opt) -> dict:
    """An ``fn.fsdp`` optimizer's per-module state (``OnebitModule``), by module."""
    return {module.layout.name: module for module in opt._modules}


def mask_bits(opt) -> dict:
    """Every module's mask as bits in the layout of ``X`` (or ``None``), by module."""
    return {name: module.mask for name, module in held(opt).items()}


def records(opt) -> dict | None:
    """``exp_avg_mask="auto"``'s records of zero gradients by module, ``None`` after the freeze
    (or without ``"auto"``)."""
    found = {name: module.record for name, module in held(opt).items()}
    return None if all(r is None for r in found.values()) else found


# ----------------------------------------------------------------------------- the workers


def _worker_train(
    rank: int,
    world_size: int,
    weight_decay: float,
    masked: bool,
    error_dtype: str,
    grouped: bool = False,
) -> dict:
    model = build(grouped=grouped)
    opt = fn.fsdp.OnebitAdam(
        model,
        lr=LR,
        freeze_step=FREEZE,
        betas=BETAS,
        eps=EPS,
        weight_decay=weight_decay,
        exp_avg_mask=masks_of(model) if masked else None,
        error_dtype=getattr(torch, error_dtype),
    )
    modules = GROUPED if grouped else MODULES
    reference = Reference(full_params(model), weight_decay, masked, error_dtype, modules)
    history, mismatches = [], []
    for t in range(1, STEPS + 1):
        grads = [local_grads(reference.p, r, t) for r in range(world_size)]
        reference.step(t, grads)
        opt.param_groups[0]["lr"] = lr_at(t)
        opt.zero_grad()
        x, y = batch(rank, t)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        got = full_params(model)
        history.append(got)
        mismatches += [(t, k) for k in got if not torch.equal(got[k], reference.p[k])]
    before = full_params(model)
    opt.zero_grad()
    x, y = batch(rank, 0)
    if rank == 1:
        x[0, 0] = torch.nan
    nn.functional.mse_loss(model(x), y).backward()
    try:
        opt.step()
        raised = None
    except fn.NonFiniteError as error:
        raised = str(error)
    after = full_params(model)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return dict(
        history=history,
        mismatches=mismatches,
        moved=[not torch.equal(history[0][k], history[-1][k]) for k in history[0]],
        bytes=opt.bytes_sent,
        nonfinite=(raised, unchanged, opt.count),
    )


def _worker_bf16(rank: int, world_size: int) -> dict:
    model = build(policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = fn.fsdp.OnebitAdam(model, lr=LR, freeze_step=FREEZE)
    start = full_params(model)
    for t in range(1, STEPS + 1):
        opt.zero_grad()
        x, y = batch(rank, t)
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
    params = full_params(model)
    grads = {k: p.grad.dtype for k, p in model.named_parameters()}
    return dict(start=start, params=params, grads=grads, count=opt.count)


def _refusal(make) -> tuple[str, str] | None:
    try:
        make()
    except (ValueError, NotImplementedError) as error:
        return type(error).__name__, str(error)
    return None


def _worker_bad_input(rank: int, world_size: int) -> dict:
    out = {}
    torch.manual_seed(0)
    out["no fsdp"] = _refusal(lambda: fn.fsdp.OnebitAdam(nn.Linear(2, 2)))

    def outside():
        model = Net()
        fully_shard(model.block, mesh=init_device_mesh("cpu", (world_size,)))
        return fn.fsdp.OnebitAdam(model)

    out["outside"] = _refusal(outside)

    def two_dim():
        model = Net()
        mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
        return fn.fsdp.OnebitAdam(model)

    out["2-d"] = _refusal(two_dim)

    def one_name_unwrapped():  # "_orig_mod.head.weight" is "head.weight" without the wrapper
        model = Net()
        model.add_module("_orig_mod", nn.Module())
        model.get_submodule("_orig_mod").add_module("head", nn.Linear(3, 2))
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
        return fn.fsdp.OnebitAdam(model)

    out["one name unwrapped"] = _refusal(one_name_unwrapped)

    def old_torch():  # a torch whose FSDP2 lacks a method fn drives
        saved = FSDPModule.set_reduce_scatter_unused_params
        del FSDPModule.set_reduce_scatter_unused_params
        try:
            return fn.fsdp.OnebitAdam(build())
        finally:
            FSDPModule.set_reduce_scatter_unused_params = saved

    out["old torch"] = _refusal(old_torch)
    out["lr differs"] = _refusal(lambda: fn.fsdp.OnebitAdam(build(), lr=0.1 * (rank + 1)))

    def masked(value: float, rank_only: int | None = None):
        model = build()
        mask = {model.head.bias: torch.full((2,), value)}
        given = mask if rank_only in (None, rank) else None
        return fn.fsdp.OnebitAdam(model, exp_avg_mask=given)

    out["mask on rank 0"] = _refusal(lambda: masked(0.5, rank_only=0))  # only 0 and 1 are built
    out["mask differs"] = _refusal(lambda: masked(float(rank)))
    auto = "auto" if rank == 0 else None  # only rank 0 asks for the automatic mask
    out["auto mask on rank 0"] = _refusal(lambda: fn.fsdp.OnebitAdam(build(), exp_avg_mask=auto))
    out["mask string"] = _refusal(lambda: fn.fsdp.OnebitAdam(build(), exp_avg_mask="zeros"))
    out["mask key"] = _refusal(lambda: fn.fsdp.OnebitAdam(build(), exp_avg_mask={"w": 1}))
    out["int8 errors"] = _refusal(lambda: fn.fsdp.OnebitAdam(build(), error_dtype=torch.int8))
    auto = "auto" if rank == 0 else 10  # only rank 0 asks for the automatic switch
    out["auto on rank 0"] = _refusal(lambda: fn.fsdp.OnebitAdam(build(), freeze_step=auto))
    out["freeze_step"] = _refusal(lambda: fn.fsdp.OnebitAdam(build(), freeze_step=1))
    model = build()
    fn.fsdp.OnebitAdam(model)
    out["second"] = _refusal(lambda: fn.fsdp.OnebitAdam(model))
    out["0/1 adam"] = _refusal(lambda: fn.fsdp.ZeroOneAdam(build(), lr=1e-3))
    return out


# ----------------------------------------------------------------------------- the tests


# (weight decay, masked, error dtype)
RUNS = {
    "plain": (0.0, False, "float32"),
    "weight decay": (0.1, False, "float32"),
    "masked": (0.0, True, "float16"),  # with fp16 errors (the allocating collective)
}
# the same, and fully_shard([block, head]): two modules in one FSDP2 group
GROUPED_RUNS = {"grouped": (0.0, True, "float32", True)}
ALL_RUNS = {**RUNS, **GROUPED_RUNS}


@pytest.fixture(scope="module")
def launched():
    """``{name: results by rank}`` of the training runs, the bf16 run and the refusals (last),
    in one launch: each builds its own model and leaves the group usable."""
    parts = {name: (_worker_train, run) for name, run in ALL_RUNS.items()}
    parts.update(bf16=(_worker_bf16, ()), bad_input=(_worker_bad_input, ()))
    return run_together(parts, WORLD, timeout=600)


@pytest.fixture(scope="module")
def trained(launched):
    return {name: launched[name] for name in ALL_RUNS}


@pytest.mark.timeout(660)
def test_bit_for_bit_with_the_reference_and_ranks_agree(trained):
    for results in trained.values():
        for rank, result in enumerate(results):
            assert result["mismatches"] == [], rank
            assert all(result["moved"])
            for t, params in enumerate(result["history"]):
                for k, value in params.items():
                    assert torch.equal(value, results[0]["history"][t][k]), (rank, t, k)
    plain, wd_on = trained["plain"][0]["history"][-1], trained["weight decay"][0]["history"][-1]
    assert not torch.equal(plain["block.weight"], wd_on["block.weight"])
    assert not torch.equal(
        plain["block.weight"], trained["masked"][0]["history"][-1]["block.weight"]
    )


@pytest.mark.timeout(660)
def test_compressed_traffic_is_counted_and_nonfinite_raises_on_every_rank(trained):
    for rank, result in enumerate(trained["plain"]):
        assert result["bytes"] > 0
        message, unchanged, count = result["nonfinite"]
        assert message is not None and "non-finite" in message, rank
        assert unchanged and count == STEPS


@pytest.mark.timeout(660)
def test_bf16_policy_keeps_fp32_masters_and_ranks_agree(launched):
    results = launched["bf16"]
    for result in results:
        assert result["count"] == STEPS
        for k, value in result["params"].items():
            assert value.dtype == torch.float32 and result["grads"][k] == torch.float32
            assert torch.equal(value, results[0]["params"][k]), k
            assert not torch.equal(value, result["start"][k]), k


@pytest.mark.timeout(660)
def test_bad_input_is_refused_on_every_rank(launched):
    results = launched["bad_input"]
    for out in results:
        assert out["no fsdp"][0] == "ValueError" and "no FSDP2 module" in out["no fsdp"][1]
        assert out["outside"][0] == "ValueError" and "head.weight" in out["outside"][1]
        assert out["2-d"][0] == "NotImplementedError" and "2-D" in out["2-d"][1]
        kind, message = out["one name unwrapped"]
        assert kind == "ValueError" and "'head.weight' and '_orig_mod.head.weight'" in message
        kind, message = out["old torch"]
        assert kind == "NotImplementedError" and "set_reduce_scatter_unused_params" in message
        assert out["lr differs"][0] == "ValueError" and "different" in out["lr differs"][1]
        kind, message = out["mask on rank 0"]
        assert kind == "NotImplementedError"
        assert message.startswith(
            "fn.fsdp.OnebitAdam: rank(s) [0] refused the model or the settings: exp_avg_mask"
        ), message  # on every rank, with rank 0's reason
        assert "0 and 1" in message and message == results[0]["mask on rank 0"][1], message
        assert out["mask differs"][0] == "ValueError" and "different" in out["mask differs"][1]
        kind, message = out["auto mask on rank 0"]
        assert kind == "ValueError" and "different" in message, message
        kind, message = out["mask string"]
        assert kind == "ValueError" and '"auto"' in message, message
        assert out["mask key"][0] == "ValueError" and "not a trainable" in out["mask key"][1]
        assert out["int8 errors"][0] == "ValueError" and "error_dtype" in out["int8 errors"][1]
        assert out["auto on rank 0"][0] == "ValueError", out["auto on rank 0"]  # differs
        assert "different" in out["auto on rank 0"][1]
        assert out["freeze_step"][0] == "ValueError" and "freeze_step" in out["freeze_step"][1]
        assert out["second"][0] == "ValueError" and "already" in out["second"][1]
        assert out["0/1 adam"][0] == "NotImplementedError" and "replica" in out["0/1 adam"][1]
