"""Gradient accumulation and clipping with fn.fsdp.OnebitAdam and OnebitLamb (docs/algorithms.md,
"Accumulation and clipping on FSDP2 and HSDP"): k micro-batches, each its own backward and
reduce-scatter, on a 1-D mesh (2 gloo ranks) and on HSDP (2 nodes x 2), through the warmup and
the compressed phase, bit for bit against the loop-over-ranks references of test_onebit.py and
test_onebit_lamb.py fed the micro-batches' gradients summed in the same order; the warmup
against one backward on the concatenated batch; the bytes across nodes independent of k;
``max_grad_norm``'s factor, the same on every rank, with a gradient spike on one rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fn
import fn.fsdp
from tests._distributed import run_together
from tests.fsdp import test_onebit, test_onebit_hsdp
from tests.fsdp.test_onebit import BETAS, EPS, FREEZE, LR, batch, full_params, lr_at
from tests.fsdp.test_onebit_hsdp import KINDS, N, hsdp_layout

STEPS = 5  # 1, 2 warm up, 3 is the freeze, 4 and 5 compressed
MICRO = (1, 2, 4)
SPIKE = (FREEZE + 1, 1)  # (update, rank): that rank's last micro-batch is scaled by 1000
MAX_NORM = 0.05


def micro_batch(rank: int, t: int, i: int, spike: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(rank, 10 * t + i)
    return (x * 1000, y) if spike and (t, rank) == SPIKE and i == 0 else (x, y)


def local_sums(kind, params, rank, t, k, spike) -> dict[str, torch.Tensor]:
    """One rank's gradient of an update: its k micro-batches' gradients of ``loss / k`` (a power
    of two: exact), summed in order."""
    total = None
    for g in micro_grads(kind, params, rank, t, k, spike):
        total = g if total is None else {n: total[n] + g[n] for n in g}
    return total


def micro_grads(kind, params, rank, t, k, spike) -> list[dict[str, torch.Tensor]]:
    module = KINDS[kind][1]
    out = []
    for i in range(k):
        x, y = micro_batch(rank, t, i, spike)
        model = module.build(shard=False)
        model.load_state_dict(params)
        (nn.functional.mse_loss(model(x), y) / k).backward()
        out.append({name: p.grad for name, p in model.named_parameters()})
    return out


def reduced(per_micro: list[list[dict]], group: list[int]) -> dict[str, torch.Tensor]:
    """What FSDP2's ``.grad`` holds after the micro-batches' dense reduce-scatters over the
    ranks ``group`` (each the sum in rank order, then / len(group)), accumulated in order."""
    total = None
    for i in range(len(per_micro[0])):
        mean = {}
        for name in per_micro[0][i]:
            s = per_micro[group[0]][i][name]
            for r in group[1:]:
                s = s + per_micro[r][i][name]
            mean[name] = s / len(group)
        total = mean if total is None else {n: total[n] + mean[n] for n in mean}
    return total


def rows_square(x: torch.Tensor, rows: int, row: int | None) -> float:
    """The fp64 sum of squares of X (flat, ``rows`` rows), or of its row ``row``."""
    x = x.view(rows, -1)
    return float((x if row is None else x[row]).reshape(-1).double().square().sum())


def shard_square(g: torch.Tensor, rows: int, j: int) -> float:
    per = -(-g.shape[0] // rows)
    return float(g[j * per : (j + 1) * per].double().square().sum())


def factor_of(per_rank: list[float], replicas: int) -> float:
    """max_grad_norm's factor, from every rank's squared sum, as fn.fsdp reduces them."""
    rows = torch.tensor([[0.0, 0.0, s] for s in per_rank], dtype=torch.float64)
    total = rows.sum(0)[2] / replicas
    return min(1.0, MAX_NORM / (float(total) ** 0.5 + 1e-6))


def factor_compressed(per_rank: list[float], replicas: int) -> float:
    rows = torch.tensor([[0.0, s, 0.0] for s in per_rank], dtype=torch.float64)
    total = rows.sum(0)[1] / replicas
    return min(1.0, MAX_NORM / (float(total) ** 0.5 + 1e-6))


def scaled(g: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return g if factor == 1.0 else {n: v * factor for n, v in g.items()}


# ----------------------------------------------------------------------------- the references


def reference_grads_1d(kind, params, t, k, clip, spike) -> list[dict]:
    """The reference's input on the 1-D mesh: the warmup's mean gradient twice (its mean is
    itself), the compressed phase's local sums."""
    module = KINDS[kind][1]
    world = test_onebit.WORLD
    if t < FREEZE:
        mean = reduced([micro_grads(kind, params, r, t, k, spike) for r in range(world)], [0, 1])
        if clip:
            order = [n for names in module.MODULES[::-1] for n in names]
            squares = [sum((shard_square(mean[n], world, j) for n in order), 0.0) for j in range(2)]
            mean = scaled(mean, factor_of(squares, 1))
        return [mean, mean]
    sums = [local_sums(kind, params, r, t, k, spike) for r in range(world)]
    if clip:
        squares = []
        for r in range(world):
            x = [module.to_x([sums[r][n] for n in names]) for names in module.MODULES[::-1]]
            squares.append(sum((rows_square(v, world, None) for v in x), 0.0))
        sums = [scaled(s, factor_compressed(squares, world)) for s in sums]
    return sums


def reference_grads_hsdp(kind, params, t, k, clip, spike) -> list[dict]:
    """The reference's input on HSDP (under hsdp_layout): the nodes' accumulated gradients,
    in the warmup their mean twice."""
    module = KINDS[kind][1]
    L = test_onebit_hsdp.L
    per_rank = [micro_grads(kind, params, r, t, k, spike) for r in range(N * L)]
    nodes = [reduced(per_rank, list(range(n * L, (n + 1) * L))) for n in range(N)]
    order = [n for names in module.MODULES[::-1] for n in names]
    if t < FREEZE:
        mean = {name: (nodes[0][name] + nodes[1][name]) / N for name in nodes[0]}
        if clip:
            squares = [sum((shard_square(mean[n], L, j) for n in order), 0.0) for j in range(L)]
            mean = scaled(mean, factor_of(squares, 1))
        return [mean, mean]
    if clip:
        squares = []
        for node in nodes:
            for j in range(L):
                x = [
                    test_onebit_hsdp.to_x([node[n] for n in names])
                    for names in module.MODULES[::-1]
                ]
                squares.append(sum((rows_square(v, L, j) for v in x), 0.0))
        nodes = [scaled(g, factor_compressed(squares, N)) for g in nodes]
    return nodes


# ----------------------------------------------------------------------------- the workers


def train(model, opt, rank: int, t: int, k: int, spike: bool) -> None:
    opt.param_groups[0]["lr"] = lr_at(t)
    opt.zero_grad()
    for i in range(k):
        x, y = micro_batch(rank, t, i, spike)
        (nn.functional.mse_loss(model(x), y) / k).backward()
    opt.step()


# (kind, micro-batches, max_grad_norm, a spike)
CASES = [(kind, k, False, False) for kind in KINDS for k in MICRO] + [
    (kind, 2, clip, True) for kind in KINDS for clip in (False, True)
]


def _run(rank: int, hsdp: bool) -> dict:
    out = {}
    for kind, k, clip, spike in CASES:
        cls, module = KINDS[kind]
        if hsdp:
            mesh = test_onebit_hsdp.hsdp_mesh()
            model = test_onebit_hsdp.build(kind, mesh=mesh["shard"])
            replicate = mesh["replicate"]
        else:
            model, replicate = module.build(), None
        opt = cls(
            model,
            lr=LR,
            freeze_step=FREEZE,
            betas=BETAS,
            eps=EPS,
            weight_decay=0.1,
            replicate=replicate,
            max_grad_norm=MAX_NORM if clip else None,
        )
        reference = module.Reference(full_params(model), 0.1)
        mismatches, history, inter = [], [], []
        for t in range(1, STEPS + 1):
            params = {n: v.clone() for n, v in reference.p.items()}
            if hsdp:
                with hsdp_layout(module):
                    reference.step(t, reference_grads_hsdp(kind, params, t, k, clip, spike))
            else:
                reference.step(t, reference_grads_1d(kind, params, t, k, clip, spike))
            before = opt.bytes_sent_by_hop
            train(model, opt, rank, t, k, spike)
            after = opt.bytes_sent_by_hop
            inter.append({hop: after[hop] - before[hop] for hop in after})
            got = full_params(model)
            history.append(got)
            mismatches += [(t, n) for n in got if not torch.equal(got[n], reference.p[n])]
        out[kind, k, clip, spike] = dict(mismatches=mismatches, history=history, bytes=inter)
    return out


def _worker_1d(rank: int, world_size: int) -> dict:
    return _run(rank, hsdp=False)


def _worker_hsdp(rank: int, world_size: int) -> dict:
    return _run(rank, hsdp=True)


def _worker_concatenated(rank: int, world_size: int) -> dict:
    """The warmup with k = 4 micro-batches against one backward on their concatenation, on a
    1-D mesh of every rank and on HSDP (N nodes of 2) where there are 4."""
    out = {}
    for kind, hsdp in [(kind, hsdp) for kind in KINDS for hsdp in (False, world_size == 4)]:
        cls, module = KINDS[kind]
        models, opts = [], []
        for _ in range(2):
            if hsdp:
                mesh = test_onebit_hsdp.hsdp_mesh()
                model = test_onebit_hsdp.build(kind, mesh=mesh["shard"])
                options = {"replicate": mesh["replicate"]}
            else:
                model, options = module.build(world=world_size), {}
            models.append(model)
            opts.append(cls(model, lr=LR, freeze_step=FREEZE, betas=BETAS, eps=EPS, **options))
        worst = 0.0
        for t in range(1, FREEZE):
            train(models[0], opts[0], rank, t, 4, spike=False)
            pieces = [micro_batch(rank, t, i, False) for i in range(4)]
            x, y = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
            opts[1].zero_grad()
            nn.functional.mse_loss(models[1](x), y).backward()
            opts[1].step()
            a, b = full_params(models[0]), full_params(models[1])
            for n in a:
                torch.testing.assert_close(a[n], b[n], rtol=1e-6, atol=1e-7)
                worst = max(worst, float((a[n] - b[n]).abs().max()))
        out[kind, hsdp] = worst
    return out


def _worker_clip_grad_norm(rank: int, world_size: int) -> dict:
    """torch's clip_grad_norm_ on .grad in the compressed phase: it acts on HSDP (the
    nodes' gradients are in .grad), silently; on a 1-D mesh, where .grad holds each rank's
    row of its own gradient, fn warns once and names max_grad_norm."""
    import warnings

    out = {}
    for hsdp in (False, True):
        params = []
        for clip in (False, True):
            if hsdp:
                mesh = test_onebit_hsdp.hsdp_mesh()
                model = test_onebit_hsdp.build("adam", mesh=mesh["shard"])
                opt = fn.fsdp.OnebitAdam(
                    model, lr=LR, freeze_step=FREEZE, replicate=mesh["replicate"]
                )
            else:
                model = test_onebit.build(world=world_size)
                opt = fn.fsdp.OnebitAdam(model, lr=LR, freeze_step=FREEZE)
            caught = []
            for t in range(1, STEPS + 1):
                opt.zero_grad()
                x, y = batch(rank, t)
                nn.functional.mse_loss(model(x) * 100, y).backward()
                if clip and t >= FREEZE:  # the compressed phase only
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    opt.step()
                caught.append([str(w.message) for w in seen if "clip_grad_norm_" in str(w.message)])
            params.append(full_params(model))
        changed = any(not torch.equal(params[0][n], params[1][n]) for n in params[0])
        out["hsdp" if hsdp else "1-d"] = dict(caught=caught, changed=changed)
    return out


# ----------------------------------------------------------------------------- the tests


def _check_runs(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        for case, result in out.items():
            assert result["mismatches"] == [], (rank, case, result["mismatches"][:4])
            for t, params in enumerate(result["history"]):
                for n, value in params.items():
                    assert torch.equal(value, results[0][case]["history"][t][n]), (rank, case, t)


# One launch for each world size: every worker builds its own models and leaves the group usable.
@pytest.fixture(scope="module")
def two_ranks():
    """``{worker: results by rank}`` of the 1-D workers on 2 ranks."""
    parts = {"1d": (_worker_1d, ()), "bf16_accumulator": (_worker_bf16_accumulator, ())}
    return run_together(parts, test_onebit.WORLD, timeout=600)


@pytest.fixture(scope="module")
def four_ranks():
    """``{worker: results by rank}`` of the workers on 4 ranks (HSDP: N nodes of L)."""
    parts = {
        "hsdp": (_worker_hsdp, ()),
        "concatenated": (_worker_concatenated, ()),
        "clip_grad_norm": (_worker_clip_grad_norm, ()),
    }
    return run_together(parts, N * test_onebit_hsdp.L, timeout=600)


@pytest.fixture(scope="module")
def hsdp_runs(four_ranks):
    return four_ranks["hsdp"]


@pytest.mark.timeout(660)
def test_accumulation_on_a_1d_mesh_is_bit_for_bit_with_the_reference(two_ranks):
    _check_runs(two_ranks["1d"])


@pytest.mark.timeout(660)
def test_accumulation_on_hsdp_is_bit_for_bit_with_the_reference(hsdp_runs):
    _check_runs(hsdp_runs)


@pytest.mark.timeout(660)
def test_bytes_across_nodes_do_not_depend_on_the_micro_batches(hsdp_runs):
    for out in hsdp_runs:
        for kind in KINDS:
            one, four = out[kind, 1, False, False]["bytes"], out[kind, 4, False, False]["bytes"]
            for t in range(STEPS):
                assert one[t]["inter"] == four[t]["inter"] > 0, (kind, t)
                assert one[t]["world"] == four[t]["world"], (kind, t)


@pytest.mark.timeout(660)
def test_warmup_accumulation_matches_one_backward_on_the_concatenated_batch(four_ranks):
    for out in four_ranks["concatenated"]:
        assert len(out) == 2 * len(KINDS)
        for case, worst in out.items():
            assert worst < 1e-6, case


@pytest.mark.timeout(660)
def test_clipping_is_one_factor_on_every_rank(hsdp_runs):
    """The clipped runs (a spike on one rank at a compressed update) equal the references,
    whose factor is computed from every rank's gradient, bit for bit on every rank
    (test_accumulation_*); here: the factor clipped at every update, so the run differs from
    the unclipped one from the first update on."""
    for out in hsdp_runs:
        for kind in KINDS:
            clipped = out[kind, 2, True, True]["history"]
            plain = out[kind, 2, False, True]["history"]
            for t in range(STEPS):
                assert any(not torch.equal(clipped[t][n], plain[t][n]) for n in plain[t]), kind


@pytest.mark.timeout(660)
def test_clip_grad_norm_on_grad_acts_on_hsdp_and_warns_on_a_1d_mesh(four_ranks):
    for out in four_ranks["clip_grad_norm"]:
        caught = out["1-d"]["caught"]
        assert all(not c for c in caught[: FREEZE - 1]), caught
        assert len(caught[FREEZE - 1]) == 1 and "max_grad_norm" in caught[FREEZE - 1][0]
        assert all(not c for c in caught[FREEZE:]), caught  # once
        assert not out["1-d"]["changed"]  # the 1-D compressed update does not read .grad
        assert out["hsdp"]["changed"] and not any(out["hsdp"]["caught"])


def _worker_bf16_accumulator(rank: int, world_size: int) -> dict:
    """accumulate_dtype=torch.bfloat16 on a 1-D mesh: the compressed phase's local gradient in
    bf16 (half the bytes), its record of .grad a buffer of its own (no view that would keep a
    micro-batch's whole fp32 input alive), the run close to the fp32 accumulator's."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = test_onebit.build()
        opt = fn.fsdp.OnebitAdam(model, lr=LR, freeze_step=FREEZE, accumulate_dtype=dtype)
        for t in range(1, STEPS + 1):
            opt.zero_grad()
            for i in range(2):
                x, y = micro_batch(rank, t, i, False)
                (nn.functional.mse_loss(model(x), y) / 2).backward()
            if t == STEPS:  # before the last step(): what the accumulation holds
                held = {}
                for name, module in test_onebit.held(opt).items():
                    written = module.written_row()
                    held[name] = (
                        module.local_gradient.dtype,
                        module.local_gradient.untyped_storage().nbytes(),
                        written.untyped_storage().nbytes() == 4 * written.numel(),
                        module.local_gradient.numel(),
                    )
            opt.step()
        out[str(dtype)] = dict(params=full_params(model), held=held)
    return out


@pytest.mark.timeout(660)
def test_a_bf16_accumulator_holds_half_the_bytes_and_trains_alike(two_ranks):
    results = two_ranks["bf16_accumulator"]
    for out in results:
        fp32, bf16 = out["torch.float32"], out["torch.bfloat16"]
        for name, (dtype, nbytes, own, numel) in bf16["held"].items():
            assert dtype == torch.bfloat16 and nbytes == 2 * numel and own, name
        for name, (dtype, nbytes, _, numel) in fp32["held"].items():
            assert dtype == torch.float32 and nbytes >= 4 * numel, name
        for n, value in bf16["params"].items():
            assert torch.equal(value, results[0]["torch.bfloat16"]["params"][n])  # ranks agree
            torch.testing.assert_close(value, fp32["params"][n], rtol=0.05, atol=2e-3)
