"""fn.fsdp.OnebitAdam and OnebitLamb on HSDP, 4 gloo ranks as 2 nodes x 2 (docs/algorithms.md,
"1-bit Adam and 1-bit LAMB on HSDP"): bit for bit against the loop-over-ranks references of
tests/fsdp/test_onebit.py and test_onebit_lamb.py, run on the nodes' mean gradients with X
laid out per row over the shard group and the 1-bit allreduce written out there (``car``) run
per row over the 2 nodes; the warmup against native HSDP + torch.optim.Adam; checkpoints resumed
bit for bit on the same mesh (on other mesh shapes: test_onebit_reshard.py); bad input refused
on every rank with nothing changed."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fn
import fn.fsdp
from tests._distributed import run_distributed, run_together
from tests.fsdp import test_onebit, test_onebit_auto_mask, test_onebit_lamb
from tests.fsdp.test_onebit import (
    BETAS,
    EPS,
    FREEZE,
    LR,
    batch,
    full_params,
    lr_at,
    mask_bits,
    masks_of,
)

N, L = 2, 2  # nodes (replicate), ranks per node (shard)
WORLD = N * L
STEPS = 6  # FREEZE = 3: updates 1, 2 warm up, 3 is the freeze
UNIT = N * math.lcm(N, 8)  # a row of X is padded to a multiple of it
SAVES = (1, FREEZE - 1, FREEZE, FREEZE + 1)  # warmup, before the freeze, at it, compressed
KINDS = {
    "adam": (fn.fsdp.OnebitAdam, test_onebit),
    "lamb": (fn.fsdp.OnebitLamb, test_onebit_lamb),
}
assert test_onebit.WORLD == N and test_onebit_lamb.WORLD == L == N  # their car and their shards
flat_car = test_onebit.car  # the flat 1-bit allreduce over N ranks (hsdp_layout swaps it)


def hsdp_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (N, L), mesh_dim_names=("replicate", "shard"))


def build(kind: str, seed: int = 0, mesh: DeviceMesh | None = None) -> nn.Module:
    """The kind's test model, every FSDP2 module on ``mesh`` (default: the HSDP mesh's shard
    dimension)."""
    torch.manual_seed(seed)
    model = KINDS[kind][1].Net()
    mesh = hsdp_mesh()["shard"] if mesh is None else mesh
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def optimizer(kind: str, model: nn.Module, replicate: DeviceMesh | None, **kwargs):
    return KINDS[kind][0](
        model, lr=LR, freeze_step=FREEZE, betas=BETAS, eps=EPS, replicate=replicate, **kwargs
    )


def train_step(model: nn.Module, opt, rank: int, t: int) -> None:
    opt.param_groups[0]["lr"] = lr_at(t)
    opt.zero_grad()
    x, y = batch(rank, t)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


# ----------------------------------------------------------------------------- the reference


# X on HSDP, flat: L rows, row l holds rows [l R, (l + 1) R) of every tensor, zero padded to a
# multiple of N lcm(N, 8)
to_x = functools.partial(test_onebit.to_x, rows=L, unit=UNIT)
from_x = functools.partial(test_onebit.from_x, rows=L, unit=UNIT)


def car_by_row(xs: list[torch.Tensor], ews: list[torch.Tensor], ess: list[torch.Tensor]):
    """The 1-bit allreduce of each row of X over the N nodes (``xs``: the nodes' X), with
    the row's errors (worker: the row, server: S' / N) as slices of the nodes' errors."""
    padded = xs[0].numel() // L
    out = []
    for j in range(L):
        row, chunk = (
            slice(j * padded, (j + 1) * padded),
            slice(j * padded // N, (j + 1) * padded // N),
        )
        w, s = [e[row].clone() for e in ews], [e[chunk].clone() for e in ess]
        out.append(flat_car([x[row] for x in xs], w, s))
        for k in range(N):
            ews[k][row], ess[k][chunk] = w[k], s[k]
    return torch.cat(out)


@contextlib.contextmanager
def hsdp_layout(module):
    """The test module's reference with X and the 1-bit allreduce of HSDP."""
    saved = module.to_x, module.from_x, module.car
    module.to_x, module.from_x, module.car = to_x, from_x, car_by_row
    try:
        yield
    finally:
        module.to_x, module.from_x, module.car = saved


def node_grads(kind: str, params: dict[str, torch.Tensor], t: int) -> list[dict]:
    """Each node's mean gradient: the sum of its L ranks' local gradients, then / L."""
    local = [KINDS[kind][1].local_grads(params, rank, t) for rank in range(WORLD)]
    nodes = []
    for k in range(N):
        ranks = local[k * L : (k + 1) * L]
        nodes.append({name: (ranks[0][name] + ranks[1][name]) / L for name in ranks[0]})
    return nodes


# ----------------------------------------------------------------------------- the workers


def _worker_train(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for kind, masked in (("adam", False), ("adam", True), ("lamb", False), ("lamb", True)):
        mesh = hsdp_mesh()
        model = build(kind, mesh=mesh["shard"])
        masks = masks_of(model) if masked else None
        opt = optimizer(kind, model, mesh["replicate"], weight_decay=0.1, exp_avg_mask=masks)
        module = KINDS[kind][1]
        reference = module.Reference(full_params(model), 0.1, masked)
        history, mismatches = {}, []
        for t in range(1, STEPS + 1):
            with hsdp_layout(module):
                reference.step(t, node_grads(kind, reference.p, t))
            train_step(model, opt, rank, t)
            history[t] = full_params(model)
            mismatches += [
                (t, k) for k, v in history[t].items() if not torch.equal(v, reference.p[k])
            ]
            if masked and t in SAVES:
                path = os.path.join(root, f"{kind}-{t}")
                fn.fsdp.TrainingCheckpoint(model, opt, step=t).save(path)
        out[kind, masked] = dict(history=history, mismatches=mismatches, bytes=opt.bytes_sent)
    # a problem one row's collective found (on its N ranks: injected on shard rank 1 of both
    # nodes) is raised on every rank, of its kind, with no param changed; the next update trains
    before = full_params(model)
    opt.zero_grad()
    x, y = batch(rank, 0)
    nn.functional.mse_loss(model(x), y).backward()
    if rank % L == 1:
        opt._problems.append(fn.NonFiniteError("injected"))
    try:
        opt.step()
        raised = None
    except fn.NonFiniteError as error:
        raised = str(error)
    after = full_params(model)
    unchanged = opt.count == STEPS and all(torch.equal(before[k], after[k]) for k in before)
    train_step(model, opt, rank, STEPS + 1)
    out["shared problem"] = (raised, unchanged, opt.count)
    model = build("lamb", mesh=init_device_mesh("cpu", (WORLD,)))  # 1-D: another trajectory
    opt = optimizer("lamb", model, None, weight_decay=0.1)
    for t in range(1, STEPS + 1):
        train_step(model, opt, rank, t)
    out["lamb 1-d"] = full_params(model)
    return out


def _worker_resume(rank: int, world_size: int, root: str, history: dict) -> dict:
    mismatches, counts = [], {}
    for kind in KINDS:
        for start in SAVES:
            mesh = hsdp_mesh()
            model = build(kind, seed=1, mesh=mesh["shard"])
            opt = optimizer(
                kind, model, mesh["replicate"], weight_decay=0.1, exp_avg_mask=masks_of(model)
            )
            fn.fsdp.TrainingCheckpoint(model, opt).load(os.path.join(root, f"{kind}-{start}"))
            counts[kind, start] = opt.count
            for t in range(start + 1, STEPS + 1):
                train_step(model, opt, rank, t)
                got = full_params(model)
                expected = history[kind, True]["history"][t]
                mismatches += [
                    (kind, start, t, k) for k in got if not torch.equal(got[k], expected[k])
                ]
    return dict(mismatches=mismatches, counts=counts)


def _worker_native(rank: int, world_size: int, shape: tuple[int, int] = (N, L)) -> dict:
    """The warmup against native HSDP (fully_shard on the 2-D mesh of ``shape``) +
    torch.optim.Adam, whose bias correction is undone by its lr and eps at every step (fn's
    warmup has none)."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    ours = build("adam", mesh=mesh["shard"])
    opt = optimizer("adam", ours, mesh["replicate"])
    native = build("adam", mesh=mesh)
    adam = torch.optim.Adam(native.parameters(), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    b1, b2 = BETAS
    worst, grads_equal = 0.0, True
    for t in range(1, FREEZE):
        train_step(ours, opt, rank, t)
        correction1, correction2 = 1 - b1**t, math.sqrt(1 - b2**t)
        adam.param_groups[0].update(lr=lr_at(t) * correction1 / correction2, eps=EPS / correction2)
        adam.zero_grad()
        x, y = batch(rank, t)
        nn.functional.mse_loss(native(x), y).backward()
        grads = {k: p.grad.full_tensor() for k, p in native.named_parameters()}
        mine = {k: p.grad.full_tensor() for k, p in ours.named_parameters()}
        grads_equal &= all(torch.equal(grads[k], mine[k]) for k in grads)
        adam.step()
        a, b = full_params(ours), full_params(native)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-9)
            worst = max(worst, float((a[k] - b[k]).abs().max()))
    return dict(worst=worst, grads_equal=grads_equal)


def _worker_auto_mask(rank: int, world_size: int) -> dict:
    """exp_avg_mask="auto" and the same mask by hand (test_onebit_auto_mask's model), with a
    fixed freeze and one freeze_step="auto" decides."""
    out = {}
    sparse = test_onebit_auto_mask
    for kind in KINDS:
        for freeze in (sparse.FREEZE, sparse.AUTO_FREEZE):
            for mask in ("auto", "hand"):
                mesh = hsdp_mesh()
                torch.manual_seed(0)
                model = sparse.Sparse()
                fully_shard(model.block, mesh=mesh["shard"])
                fully_shard(model, mesh=mesh["shard"])
                hand = sparse.hand_masks()
                masks = {p: hand[k] for k, p in model.named_parameters() if k in hand}
                opt = KINDS[kind][0](
                    model,
                    lr=1e-2,
                    freeze_step=freeze,
                    betas=(0.9, 0.99),
                    weight_decay=0.1,
                    exp_avg_mask="auto" if mask == "auto" else masks,
                    replicate=mesh["replicate"],
                )
                params = {}
                for t in range(1, sparse.STEPS + 1):
                    sparse.train_step(model, opt, rank, t)
                    params[t] = full_params(model)
                switch = int(opt._state.auto.freeze_at) if opt._state.auto is not None else freeze
                held = mask_bits(opt)
                out[kind, str(freeze), mask] = dict(params=params, masks=held, switch=switch)
    return out


def _worker_precision(rank: int, world_size: int) -> dict:
    """bf16 and fp16 errors, and bf16 params under FSDP2's MixedPrecisionPolicy (fp32 masters),
    through the freeze."""
    out = {}
    cases = (
        ("bf16 errors", torch.bfloat16, None),
        ("fp16 errors", torch.float16, None),
        ("bf16 params", torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
    )
    for kind in KINDS:
        for case, error_dtype, policy in cases:
            mesh = hsdp_mesh()
            torch.manual_seed(0)
            model = KINDS[kind][1].Net()
            mp = {} if policy is None else {"mp_policy": policy}
            fully_shard(model.block, mesh=mesh["shard"], **mp)
            fully_shard(model, mesh=mesh["shard"], **mp)
            opt = optimizer(kind, model, mesh["replicate"], error_dtype=error_dtype)
            start = full_params(model)
            for t in range(1, STEPS + 1):
                opt.param_groups[0]["lr"] = lr_at(t)
                opt.zero_grad()
                x, y = batch(rank, t)
                nn.functional.mse_loss(model(x).float(), y).backward()
                opt.step()
            errors = {e.dtype for module in opt._modules for e in module.errors}
            out[kind, case] = dict(start=start, params=full_params(model), errors=errors)
    return out


def _refusal(make) -> tuple[str, str] | None:
    try:
        make()
    except (ValueError, NotImplementedError, TypeError) as error:
        return type(error).__name__, str(error)
    return None


def _worker_bad_input(rank: int, world_size: int) -> dict:
    out = {}
    mesh = hsdp_mesh()
    replicate = mesh["replicate"]
    out["2-d"] = _refusal(lambda: optimizer("adam", build("adam", mesh=mesh), replicate))
    out["2-d, no replicate"] = _refusal(lambda: optimizer("adam", build("adam", mesh=mesh), None))
    out["no replicate"] = _refusal(lambda: optimizer("adam", build("adam"), None))
    out["not a mesh"] = _refusal(lambda: optimizer("adam", build("adam"), "replicate"))
    out["2-d replicate"] = _refusal(lambda: optimizer("adam", build("adam"), mesh))
    shard = mesh["shard"]
    out["replicate is shard"] = _refusal(
        lambda: optimizer("adam", build("adam", mesh=shard), shard)
    )
    # every rank's meshes fine alone, but nodes 0 and 1 pass the replicate dimension of other
    # 2-D meshes: the replicate sets {0, 2}, {1, 3}, {1, 2}, {0, 3} do not partition the world
    other = DeviceMesh("cpu", [[0, 1], [3, 2]], mesh_dim_names=("replicate", "shard"))
    mixed = replicate if rank < L else other["replicate"]
    out["not a partition"] = _refusal(lambda: optimizer("adam", build("adam"), mixed))
    out["local_world_size"] = _refusal(
        lambda: optimizer("adam", build("adam"), replicate, local_world_size=2)
    )
    node = rank // L
    model = build("lamb")
    out["lr differs across nodes"] = _refusal(
        lambda: KINDS["lamb"][0](model, lr=0.1 * (node + 1), replicate=replicate)
    )
    optimizer("lamb", model, replicate)  # nothing was installed by the refused one
    out["0/1 adam"] = _refusal(lambda: fn.fsdp.ZeroOneAdam(build("adam"), replicate=replicate))
    # one node of every rank: the shard mesh holds the world, and only rank 0 passes the
    # (one-rank) replicate mesh; the ranks still meet in one agreement, over the world
    whole = init_device_mesh("cpu", (1, N * L), mesh_dim_names=("replicate", "shard"))
    some = whole["replicate"] if rank == 0 else None
    out["replicate on one rank"] = _refusal(
        lambda: optimizer("adam", build("adam", mesh=whole["shard"]), some)
    )
    # replicate= passed on one node only: the other node's ranks refuse their shard mesh alone,
    # and every rank reads why
    for passing in range(N):
        some = replicate if node == passing else None
        out["replicate on node", passing] = _refusal(
            lambda: optimizer("adam", build("adam"), some)  # noqa: B023 (called at once)
        )
    # world=: the node's ranks (each rank creates both nodes' groups), which the meshes leave;
    # every rank (a group of all 4, not the default one) with mixed meshes; not a group
    nodes = [torch.distributed.new_group(list(range(n * L, (n + 1) * L))) for n in range(N)]
    out["world is the node"] = _refusal(
        lambda: optimizer("adam", build("adam"), replicate, world=nodes[node])
    )
    out["world is the node, 1-d"] = _refusal(
        lambda: optimizer("adam", build("adam", mesh=whole["shard"]), None, world=nodes[node])
    )
    everyone = torch.distributed.new_group(list(range(WORLD)))
    out["not a partition of world"] = _refusal(
        lambda: optimizer("adam", build("adam"), mixed, world=everyone)
    )
    out["world not a group"] = _refusal(
        lambda: optimizer("adam", build("adam"), replicate, world=[0, 1])
    )
    # an installer that agrees over the shard group names the refusing rank in the world
    bits = 8.0 if rank == WORLD - 1 else 8
    out["bits on the last rank"] = _refusal(
        lambda: fn.fsdp.quantized_all_gather(build("adam"), bits=bits)
    )
    return out


# torchrun's node variables, which the node cases set or clear
NODE_VARIABLES = ("GROUP_RANK", "LOCAL_WORLD_SIZE")
RIGHT, SWAPPED = ("replicate", "shard"), ("shard", "replicate")


def _on_nodes(rank: int, shape, names, env: dict, host: str | None = None, model=None) -> dict:
    """fn.fsdp.OnebitAdam on the mesh of ``shape`` and dimension ``names``, the model sharded on
    its "shard" dimension (or ``model``, built on another), with ``env`` as this rank's node
    variables and ``host`` as its hostname: the refusal's message or None, fn's warnings, and
    the model."""
    variables = {k: v for k, v in os.environ.items() if k not in NODE_VARIABLES}
    hostname = (
        mock.patch("socket.gethostname", return_value=host) if host else contextlib.nullcontext()
    )
    with mock.patch.dict(os.environ, {**variables, **env}, clear=True), hostname:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            model = build("adam", mesh=mesh["shard"]) if model is None else model
            try:
                optimizer("adam", model, mesh["replicate"])
                refused = None
            except ValueError as error:
                refused = str(error)
    said = [str(w.message) for w in caught if str(w.message).startswith("fn.")]
    return dict(refused=refused, warnings=said, model=model)


def _worker_nodes(rank: int, world_size: int) -> dict:
    """The mesh's dimensions against the ranks' nodes, told by torchrun's variables or by the
    hostnames (2 nodes x 2 unless named)."""
    out = {}
    two, four = {"LOCAL_WORLD_SIZE": "2"}, {"LOCAL_WORLD_SIZE": "4"}
    node = f"node{rank // L}"
    cases = {
        "swapped, LOCAL_WORLD_SIZE": ((N, L), SWAPPED, two, None),
        "right, LOCAL_WORLD_SIZE": ((N, L), RIGHT, two, None),
        "swapped, GROUP_RANK": ((N, L), SWAPPED, {"GROUP_RANK": str(rank // L)}, None),
        "swapped, hostnames": ((N, L), SWAPPED, {}, node),
        "right, hostnames": ((N, L), RIGHT, {}, node),
        # the hostnames show 2 nodes where torchrun's variables say one: they decide
        "swapped, hostnames over LOCAL_WORLD_SIZE": ((N, L), SWAPPED, four, node),
        # one node (torchrun --nproc-per-node 4 on one machine): nothing is said
        "swapped, one node": ((N, L), SWAPPED, four, None),
        "swapped, nothing known": ((N, L), SWAPPED, {}, None),
        # 1 x 4 over 2 nodes: no replicate dimension, 1-D FSDP2 across nodes
        "1 x 4 on 2 nodes": ((1, WORLD), RIGHT, two, None),
        # a shard group across nodes, the replicate groups too: warned
        "a rank per node": ((N, L), RIGHT, {"LOCAL_WORLD_SIZE": "1"}, None),
        # nodes of 3 ranks and 1: shard group [2, 3] across them, replicate [0, 2] inside one
        "uneven nodes": ((N, L), RIGHT, {"GROUP_RANK": str(int(rank == 3))}, None),
    }
    for case, (shape, names, env, host) in cases.items():
        out[case] = _on_nodes(rank, shape, names, env, host)
        model = out[case].pop("model")
        if out[case]["refused"]:  # nothing was installed: the model takes an optimizer again
            out[case]["again"] = _on_nodes(rank, shape, names, {}, None, model)["refused"]
    return out


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``(root, {worker: results by rank})``: the training run, which saves under ``root``, and
    the other workers (each builds its own model and leaves the group usable), in one launch."""
    root = str(tmp_path_factory.mktemp("hsdp"))
    parts = {
        "train": (_worker_train, (root,)),
        "native": (_worker_native, ()),
        "auto_mask": (_worker_auto_mask, ()),
        "precision": (_worker_precision, ()),
        "bad_input": (_worker_bad_input, ()),
        "nodes": (_worker_nodes, ()),
    }
    return root, run_together(parts, WORLD, timeout=600)


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_bit_for_bit_with_the_reference_and_all_ranks_agree(launched):
    results = launched[1]["train"]
    for case in (("adam", False), ("adam", True), ("lamb", False), ("lamb", True)):
        first = results[0][case]["history"]
        for rank, result in enumerate(results):
            assert result[case]["mismatches"] == [], (case, rank, result[case]["mismatches"])
            assert result[case]["bytes"] > 0
            for t, params in result[case]["history"].items():
                assert all(torch.equal(v, first[t][k]) for k, v in params.items()), (case, t)
        assert not all(torch.equal(v, first[1][k]) for k, v in first[STEPS].items())
    for rank, result in enumerate(results):
        raised, unchanged, count = result["shared problem"]
        assert raised is not None and unchanged and count == STEPS + 1, (rank, raised)
        assert ("injected" in raised) == (rank % L == 1), raised
    hsdp = results[0]["lamb", False]["history"][STEPS]
    assert not torch.equal(hsdp["block.weight"], results[0]["lamb 1-d"]["block.weight"])


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_checkpoints_resume_bit_for_bit_on_the_same_mesh(launched):
    root, results = launched[0], launched[1]["train"]
    history = results[0]
    history = {case: history[case] for case in (("adam", True), ("lamb", True))}
    resumed = run_distributed(_worker_resume, WORLD, root, history, timeout=240)
    for rank, result in enumerate(resumed):
        assert result["mismatches"] == [], (rank, result["mismatches"][:4])
        assert result["counts"] == {(k, t): t for k in KINDS for t in SAVES}


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_warmup_matches_native_hsdp_and_adam(launched):
    for result in launched[1]["native"]:
        assert result["worst"] < 1e-6, result


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_auto_mask_equals_the_hand_mask_with_fixed_and_decided_freeze(launched):
    results = launched[1]["auto_mask"]
    steps = test_onebit_auto_mask.STEPS
    for rank, out in enumerate(results):
        for kind in KINDS:
            for freeze in (test_onebit_auto_mask.FREEZE, test_onebit_auto_mask.AUTO_FREEZE):
                auto, hand = out[kind, str(freeze), "auto"], out[kind, str(freeze), "hand"]
                assert auto["switch"] == hand["switch"] < steps, (kind, freeze)
                for name, bits in hand["masks"].items():
                    assert torch.equal(auto["masks"][name], bits), (rank, kind, name)
                for t in range(1, steps + 1):
                    for k, value in hand["params"][t].items():
                        assert torch.equal(auto["params"][t][k], value), (rank, kind, t, k)
                        first = results[0][kind, str(freeze), "auto"]["params"][t][k]
                        assert torch.equal(auto["params"][t][k], first), (rank, kind, t, k)


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_low_precision_errors_and_bf16_params_train_with_every_rank_equal(launched):
    results = launched[1]["precision"]
    for case, first in results[0].items():
        expected = {"bf16 errors": torch.bfloat16, "fp16 errors": torch.float16}
        assert first["errors"] == {expected.get(case[1], torch.float32)}, case
        for rank, out in enumerate(results):
            for k, value in out[case]["params"].items():
                assert value.dtype == torch.float32 and bool(value.isfinite().all()), (case, k)
                assert torch.equal(value, first["params"][k]), (rank, case, k)
                assert not torch.equal(value, first["start"][k]), (case, k)


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_bad_input_is_refused_on_every_rank(launched):
    results = launched[1]["bad_input"]
    form = 'fully_shard(..., mesh=mesh["shard"])'
    for rank, out in enumerate(results):
        for case in ("2-d", "2-d, no replicate"):
            kind, message = out[case]
            assert kind == "NotImplementedError" and form in message, (rank, message)
            assert 'OnebitAdam(model, ..., replicate=mesh["replicate"])' in message
        kind, message = out["no replicate"]
        assert kind == "ValueError" and "replicate=" in message, message
        assert out["not a mesh"][0] == "TypeError" and "DeviceMesh" in out["not a mesh"][1]
        assert out["2-d replicate"][0] == "TypeError", out["2-d replicate"]
        assert out["replicate is shard"][0] == "ValueError", out["replicate is shard"]
        kind, message = out["not a partition"]
        assert kind == "ValueError" and "partition" in message, message
        kind, message = out["local_world_size"]
        assert kind == "NotImplementedError" and "replicate=" in message, message
        kind, message = out["lr differs across nodes"]
        assert kind == "ValueError" and "different" in message, message
        kind, message = out["0/1 adam"]
        assert kind == "NotImplementedError" and "HSDP" in message, message
        kind, message = out["replicate on one rank"]
        assert kind == "ValueError" and "different" in message, message
        node = list(range(rank // L * L, rank // L * L + L))
        for case in ("world is the node", "world is the node, 1-d"):
            kind, message = out[case]
            assert kind == "ValueError" and f"ranks outside world= (ranks {node})" in message
            assert message.startswith(f"fn.fsdp.OnebitAdam: rank(s) {node} refused"), message
        kind, message = out["not a partition of world"]
        assert kind == "ValueError" and "do not partition world= (ranks [0, 1, 2, 3])" in message
        kind, message = out["world not a group"]
        assert kind == "TypeError" and "ProcessGroup" in message, message
    for rank, out in enumerate(results):
        if rank // L == N - 1:
            assert out["bits on the last rank"] == (
                "TypeError",
                f"fn.fsdp.quantized_all_gather: rank(s) [{WORLD - 1}] refused the model or the "
                "settings: bits must be an int, got 8.0 (float)",
            )
        else:  # the other nodes' shard groups installed it
            assert out["bits on the last rank"] is None
    for passing in range(N):  # the same error on every rank, with the reason
        refusing = [r for r in range(WORLD) if r // L != passing]
        kind, message = results[0]["replicate on node", passing]
        assert kind == "ValueError" and message.startswith(
            f"fn.fsdp.OnebitAdam: rank(s) {refusing} refused the model or the settings: the "
            "model's 1-D shard mesh holds 2 of the 4 ranks: the ranks outside it would drift "
            "apart unnoticed. "
        ), message
        assert 'replicate=mesh["replicate"]' in message, message
        for out in results:
            assert out["replicate on node", passing] == (kind, message)


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_mesh_dimensions_against_the_nodes(launched):
    results = launched[1]["nodes"]
    refused = {
        "swapped, LOCAL_WORLD_SIZE", "swapped, GROUP_RANK", "swapped, hostnames",
        "swapped, hostnames over LOCAL_WORLD_SIZE",
    }  # fmt: skip
    warned = {"a rank per node", "uneven nodes"}
    for case, first in results[0].items():
        for rank, out in enumerate(results):
            got = out[case]
            if case in refused:
                assert got["refused"] == first["refused"], (case, rank, got["refused"])
                assert "swapped" in got["refused"], (case, got["refused"])
                assert 'mesh_dim_names=("replicate", "shard")' in got["refused"]
                assert got["again"] is None, (case, rank, got["again"])
            else:
                assert got["refused"] is None, (case, rank, got["refused"])
            if case in warned:
                assert len(got["warnings"]) == 1, (case, rank, got["warnings"])
                assert "spans nodes" in got["warnings"][0], got["warnings"]
            else:
                assert got["warnings"] == [], (case, rank, got["warnings"])
    by = {case: results[0][case]["refused"] for case in refused}
    assert (
        "[0, 2]" in by["swapped, LOCAL_WORLD_SIZE"]
        and "LOCAL_WORLD_SIZE" in by["swapped, LOCAL_WORLD_SIZE"]
    )
    assert "hostnames" in by["swapped, hostnames over LOCAL_WORLD_SIZE"]
