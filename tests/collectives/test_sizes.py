"""Size records travel in the first exchange of the compressed collectives: ranks that pass
tensors of different sizes (also of padded sizes that differ, which gloo cannot receive) or
different sets of tensors all raise the same clear ValueError before anything size-dependent is
sent, at no extra collective, with every input and state unchanged, and the group stays usable
(4 gloo ranks, one launch)."""

from __future__ import annotations

import pytest
import torch

from fn.collectives import (
    LocoAllreduceState,
    ProcessGroup,
    Simulated,
    cast_allreduce,
    compressed_allreduce,
    init_error_feedback,
    loco_allreduce,
    quantized_allreduce,
    quantized_padded_numel,
    quantized_reduce_scatter,
    replicate,
    simulate,
)
from fn.tree import tree_leaves, tree_map
from tests._distributed import run_distributed
from tests._mirror import Mirror

pytestmark = pytest.mark.distributed

GROUP = 32  # 64 and 300 elements pad to different sizes on 2 and on 4 ranks


def error_message(run):
    """The message of the ValueError that ``run()`` raises, or ``None``."""
    try:
        run()
    except ValueError as err:
        return str(err)
    return None


def _attempt(run, *tensors):
    """``(error_message(run), whether every tensor leaf of tensors kept its values)``."""
    leaves = [t for t in tree_leaves(tensors) if t is not None]
    before = [t.clone() for t in leaves]
    message = error_message(run)
    return message, all(map(torch.equal, before, leaves))


def _quantized(comm, updates, donate, local=None):
    tx = quantized_allreduce(4, GROUP, comm=comm, local_world_size=local)
    return _attempt(lambda: tx.update(updates, tx.init(updates), donate=donate), updates)


def _loco(comm, updates, donate, local=None):
    """From nonzero errors (count 1: no reset), so that an unchanged state means something."""
    tx = loco_allreduce(4, GROUP, comm=comm, local_world_size=local)
    errors = tree_map(torch.randn_like, tx.init(updates).errors)
    state = LocoAllreduceState(torch.ones((), dtype=torch.int64), errors)
    return _attempt(lambda: tx.update(updates, state, donate=donate), updates, state)


def _reduce_scatter(comm, n, into, local=None):
    x = torch.randn(n)
    shard = quantized_padded_numel(n, comm.world_size, GROUP) // comm.world_size
    out = torch.full((shard,), 7.0) if into else None
    kwargs = dict(comm=comm, group_size=GROUP, local_world_size=local, out=out)
    return _attempt(lambda: quantized_reduce_scatter(x, **kwargs), x, out)


def _onebit(comm, n):
    we, se = init_error_feedback(n, comm=comm)
    x = torch.randn(n)
    return _attempt(lambda: compressed_allreduce(x, we, se, comm=comm), x, we, se)


def _cases(comm, n, hops=(None,)):
    """Every path of the quantized collectives with ``n`` elements on this rank: pure and
    donated (on one hop, the donated chunks go point to point), for each ``local_world_size``
    of ``hops``."""
    out = {}
    for local in hops:
        for donate in (False, True):
            out["quantized_allreduce", donate, local] = _quantized(
                comm, {"x": torch.randn(n)}, donate, local
            )
            out["loco_allreduce", donate, local] = _loco(comm, {"x": torch.randn(n)}, donate, local)
            out["quantized_reduce_scatter", donate, local] = _reduce_scatter(comm, n, donate, local)
    return out


def _worker(rank, world_size):
    import torch.distributed as dist

    world = ProcessGroup(timeout=30)
    pair = dist.new_group([0, 1])  # called on every rank
    out = {}
    if rank < 2:
        comm = ProcessGroup(pair, timeout=30)
        out["pair"] = _cases(comm, (64, 300)[rank])
        out["onebit 64/60"] = _onebit(comm, (64, 60)[rank])
        # different sets of tensors, every leaf the same size on both ranks
        missing = {"a": torch.randn(300), "b": torch.randn(64) if rank == 0 else None}
        leaf = torch.randn(64)
        moved = {"a": leaf, "b": None} if rank == 0 else {"a": None, "b": leaf}
        for donate in (False, True):
            out["missing", donate] = _loco(comm, missing, donate)
            out["moved", donate] = _quantized(comm, moved, donate)
        # the same tensors, other settings that size the messages (gloo aborted the process)
        x = {"x": torch.randn(256)}
        built = {
            "bits": quantized_allreduce((4, 8)[rank], GROUP, comm=comm),
            "group_size": loco_allreduce(4, (GROUP, 2 * GROUP)[rank], comm=comm),
            "dtype": cast_allreduce((torch.float32, torch.bfloat16)[rank], comm=comm),
        }
        for name, tx in built.items():
            out["settings", name] = _attempt(lambda tx=tx: tx.update(x, tx.init(x)), x)
        # the same count in another shape: the values are reduced flat
        tx = loco_allreduce(4, GROUP, comm=comm)
        y = torch.linspace(-1, 1, 64) * (rank + 1)
        shaped = y.view(8, 8) if rank == 0 else y
        out["shapes"] = [tx.update({"x": v}, tx.init({"x": v}))[0]["x"] for v in (shaped, y)]
        out["pair after"] = _cases(comm, 64)
    # 4 ranks, one hop and two (2 nodes of 2): only rank 3 differs, inside node 1
    out["world"] = _cases(world, 300 if rank == 3 else 64, hops=(None, 2))
    out["world after"] = _cases(world, 64, hops=(None, 2))
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4, timeout=200)


def _same_error_everywhere(results, key, ranks):
    """The one message that every rank of ``ranks`` raised for ``key`` (a path of ``results``'
    dicts), each with every tensor unchanged."""
    outcomes = []
    for rank in ranks:
        outcome = results[rank]
        for part in key:
            outcome = outcome[part]
        outcomes.append(outcome)
    (message,) = {message for message, _ in outcomes}
    assert message is not None, key
    assert all(unchanged for _, unchanged in outcomes), f"{key}: a tensor was changed"
    return message


@pytest.mark.timeout(240)
def test_different_sizes_raise_the_same_error_on_every_rank_and_change_nothing(results):
    four = ", ".join(f"rank {r}: 64 elements" for r in range(3)) + ", rank 3: 300 elements"
    for scope, ranks, counts, cases in (
        ("pair", (0, 1), "rank 0: 64 elements, rank 1: 300 elements", 6),
        ("world", range(4), four, 12),
    ):
        assert len(results[0][scope]) == cases  # 3 collectives, pure and donated, 1 (2) hops
        for case in results[0][scope]:
            message = _same_error_everywhere(results, (scope, case), ranks)
            assert message == (
                f"quantized allreduce: the ranks passed tensors of different sizes ({counts}); "
                "every rank must pass the same number of elements. Nothing was changed."
            ), (scope, case)
    message = _same_error_everywhere(results, ("onebit 64/60",), (0, 1))
    assert message.startswith("compressed_allreduce: the ranks passed tensors of different")
    assert "rank 0: 64 elements, rank 1: 60 elements" in message


@pytest.mark.timeout(240)
def test_different_sets_of_tensors_raise_before_any_leaf_moves(results):
    for key in ("missing", "moved"):
        for donate in (False, True):
            message = _same_error_everywhere(results, ((key, donate),), (0, 1))
            assert "the ranks passed different sets of tensors" in message, message
    assert "rank 0: 300 elements, rank 1: 300 elements" in results[0]["missing", True][0]
    for setting in ("bits", "group_size", "dtype"):
        message = _same_error_everywhere(results, (("settings", setting),), (0, 1))
        assert "the ranks passed different sets of tensors or settings" in message, message


@pytest.mark.timeout(240)
def test_the_same_count_in_another_shape_is_reduced_flat(results):
    (shaped0, flat0), (shaped1, flat1) = results[0]["shapes"], results[1]["shapes"]
    assert shaped0.shape == (8, 8) and shaped1.shape == (64,)
    assert torch.equal(shaped0.reshape(-1), flat0) and torch.equal(shaped1, flat1)


@pytest.mark.timeout(240)
def test_the_group_stays_usable_after_the_errors(results):
    for scope, ranks, cases in (("pair after", (0, 1), 6), ("world after", range(4), 12)):
        for rank in ranks:
            assert len(results[rank][scope]) == cases
            for key, (message, _) in results[rank][scope].items():
                assert message is None, (scope, rank, key, message)


class _Disagreeing(Mirror):
    """Two ranks whose size records say rank 1 holds twice this rank's elements."""

    def all_to_all(self, x):
        out = super().all_to_all(x)
        if x.dtype == torch.float32 and x.shape[-1] == 3:  # the records
            out = out * torch.tensor([[1.0], [2.0]])
        return out


@pytest.mark.timeout(120)
def test_the_check_stays_in_compiled_graphs():
    comm = _Disagreeing()

    def shard(x):
        return quantized_reduce_scatter(x, comm=comm, group_size=GROUP)

    for run in (shard, torch.compile(shard)):
        with pytest.raises(ValueError, match=r"\(rank 0: 64 elements, rank 1: 128 elements\)"):
            run(torch.randn(64))


def test_the_record_is_12_bytes_per_rank_in_the_quantized_collectives():
    """Per rank, on W ranks: the records' all_to_all sends 12 (W - 1) bytes, the chunks' all_to_all
    (W - 1) / W of this rank's codes and scales, the all-gather W - 1 shards of them."""
    w, n = 4, 1000
    comm = Simulated(w)
    padded = quantized_padded_numel(n, w, GROUP)
    codes_and_scales = padded // 2 + padded // GROUP * 4  # 4 bits a value, fp32 scales
    shard = codes_and_scales // w
    tx = quantized_allreduce(4, GROUP, comm=comm)
    grads = {"x": torch.randn(w, n)}
    simulate(tx.update, comm)(grads, replicate(tx.init({"x": torch.zeros(n)}), comm))
    records = 12 * (w - 1)
    reduce_scatter = (w - 1) * codes_and_scales // w
    all_gather = (w - 1) * shard
    assert comm.bytes_sent == records + reduce_scatter + all_gather


def test_matching_sizes_send_the_count_next_to_the_scales():
    """The 1-bit count is 8 bytes next to each rank's scale; the results do not change
    (tests/collectives/*)."""
    comm = Simulated(2)
    n = 64
    we, se = replicate(init_error_feedback(n, comm=comm), comm)
    simulate(lambda x, a, b: compressed_allreduce(x, a, b, comm=comm), comm)(
        torch.randn(2, n), we, se
    )
    # signs all_to_all (n/8 bytes, half sent) + (scale, count) all_gather (12 bytes)
    # + server signs (n/16 bytes) and server scale all_gathers
    assert comm.bytes_sent == n // 8 // 2 + 12 + n // 16 + 4
