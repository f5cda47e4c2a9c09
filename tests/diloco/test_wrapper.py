"""fn.diloco.DiLoCo on one process: the hook on torch.optim and fn.optim optimizers, and the
settings it refuses. The distributed behaviour is in test_gloo.py."""

from __future__ import annotations

import pytest
import torch

import fn
import fn.diloco
import fn.optim
from fn.collectives import Local, Simulated
from tests.diloco import _reference


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _step(model, inner, step):
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 3, generator=g)).square().mean().backward()
    inner.step()
    inner.zero_grad()


def _inner(kind, model):
    if kind == "torch":
        return torch.optim.Adam(model.parameters(), lr=0.05)
    return fn.optim.FunctionalOptimizer(model.parameters(), fn.adam(lr=0.05))


@pytest.mark.parametrize("kind", ["torch", "fn.optim"])
def test_every_sync_every_inner_steps_the_anchor_takes_the_outer_step(kind):
    """Against the same model and optimizer without the hook, with DiLoCo's outer step written
    out (one worker: the mean pseudo-gradient is its own; Nesterov, lr 0.7, momentum 0.9)."""
    model, plain = _model(), _model()
    inner, plain_inner = _inner(kind, model), _inner(kind, plain)
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=3)
    anchor = [p.detach().clone() for p in plain.parameters()]
    momentum = [torch.zeros_like(a) for a in anchor]
    for step in range(7):
        _step(model, inner, step)
        _step(plain, plain_inner, step)
        if step % 3 == 2:
            with torch.no_grad():
                for j, p in enumerate(plain.parameters()):
                    delta = _reference.cast_mean([anchor[j] - p], torch.float32)
                    momentum[j] = momentum[j] * 0.9 + delta
                    anchor[j] = anchor[j] + torch.add(delta, momentum[j], alpha=0.9) * -0.7
                    p.copy_(anchor[j])
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p, q), step
    assert (diloco.inner_steps, diloco.outer_steps, diloco.skipped_steps) == (7, 2, 0)


def test_refusals():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="steps tensors that are not parameters of the model"):
        fn.diloco.DiLoCo(model, torch.optim.SGD(_model().parameters(), lr=0.1), sync_every=4)
    with pytest.raises(ValueError, match="buffers must be one of mean, local"):
        fn.diloco.DiLoCo(model, inner, sync_every=4, buffers="sum")
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler"):
        fn.diloco.DiLoCo(model, inner, sync_every=4, grad_scaler=object())
    with pytest.raises(ValueError, match="max_sit_outs"):
        fn.diloco.DiLoCo(model, inner, sync_every=4, max_sit_outs=0)
    with pytest.raises(ValueError, match="delay"):  # below sync_every / fragments
        fn.diloco.DiLoCo(model, inner, sync_every=4, delay=4)
    with pytest.raises(ValueError, match="outer must be one of"):
        fn.diloco.DiLoCo(model, inner, sync_every=4, outer="adam")
    with pytest.raises(ValueError, match="compression must be None or 'topk'"):
        fn.diloco.DiLoCo(model, inner, sync_every=4, outer="sparseloco", compression="int8")
    with pytest.raises(ValueError, match="sync_every"):
        fn.diloco.DiLoCo(model, inner, sync_every=0)
    with pytest.raises(TypeError, match="not Simulated"):
        fn.diloco.DiLoCo(model, inner, sync_every=4, group=Simulated(2))
    complex_model = torch.nn.Linear(2, 2, dtype=torch.complex64)
    complex_inner = torch.optim.SGD(complex_model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="parameter 0 is torch.complex64: .*view_as_real"):
        fn.diloco.DiLoCo(complex_model, complex_inner, sync_every=4)
    with pytest.raises(TypeError, match="pseudo_gradient: a leaf is torch.complex64"):
        fn.diloco.pseudo_gradient({"w": torch.zeros(1)}, {"w": torch.zeros(1, dtype=torch.cfloat)})
    saved = fn.diloco.DiLoCo(model, inner, sync_every=4, group=Local()).state_dict()
    other = fn.diloco.DiLoCo(model, inner, sync_every=5)
    with pytest.raises(ValueError, match="settings"):
        other.load_state_dict(saved)


@pytest.mark.parametrize("kind", ["torch", "fn.optim"])
def test_a_worker_alone_that_sits_out_is_reset(kind):
    """One worker (Local) with a NaN parameter before the outer step: no participant, the step
    is skipped, the parameters return to the anchor and the inner optimizer's state restarts;
    the next outer step trains."""
    model = _model()
    inner = _inner(kind, model)
    steps = []

    def poison(*_):  # registered first: runs before DiLoCo's hook, after the inner step
        steps.append(1)
        if len(steps) == 2:
            with torch.no_grad():
                model.weight[0, 0] = float("nan")

    inner.register_step_post_hook(poison)
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=2)
    anchor = [p.detach().clone() for p in model.parameters()]
    _step(model, inner, 0)
    with pytest.warns(RuntimeWarning, match="every worker sat out the outer step started after"):
        _step(model, inner, 1)
    assert all(torch.equal(a, p) for a, p in zip(anchor, model.parameters(), strict=True))
    fresh = not inner.state if kind == "torch" else inner.state_dict()["state"][0]["step"] == 0
    assert fresh and diloco.sat_out == [1] and diloco.skipped_steps == 1
    for step in (2, 3):
        _step(model, inner, step)
    assert diloco.sat_out == [1] and diloco.outer_steps == 2
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    assert not all(torch.equal(a, p) for a, p in zip(anchor, model.parameters(), strict=True))


def test_a_caught_step_counts_with_count_inner_step_and_a_grad_scaler_counts_updates():
    """fn.optim raises NonFiniteError on a NaN gradient (nothing changes); the loop catches it
    and counts the iteration. A GradScaler's skipped step counts through its update()."""
    model = _model()
    inner = _inner("fn.optim", model)
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=2)
    for step in range(4):
        model(torch.randn(4, 3)).square().mean().backward()
        if step == 1:
            model.weight.grad[0, 0] = float("nan")
        try:
            inner.step()
        except fn.NonFiniteError:
            diloco.count_inner_step()
        inner.zero_grad()
    assert (diloco.inner_steps, diloco.outer_steps) == (4, 2)
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=2, grad_scaler=scaler)
    for step in range(4):
        scaler.scale(model(torch.randn(4, 3)).square().mean()).backward()
        if step == 1:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(inner)  # skipped at step 1
        scaler.update()
        inner.zero_grad()
    assert (diloco.inner_steps, diloco.outer_steps) == (4, 2)
    diloco.remove()  # the class's own update() again: no longer counted
    scaler.scale(model(torch.randn(4, 3)).square().mean()).backward()
    scaler.step(inner)
    scaler.update()
    assert "update" not in vars(scaler) and diloco.inner_steps == 4


def test_close_waits_for_the_exchange_in_flight_and_applies_nothing():
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=4, fragments=2, delay=1)
    for step in range(3):
        _step(model, inner, step)  # fragment 1's exchange starts after step 2 (of 4 per H)
    assert diloco.state_dict()["in_flight"]["fragment"] is not None
    trained = [p.detach().clone() for p in model.parameters()]
    diloco.close()
    state = diloco.state_dict()
    assert state["in_flight"]["fragment"] is None and diloco.outer_steps == 1
    _step(model, inner, 3)  # no longer counted, and no outer step lands
    assert diloco.inner_steps == 3 and diloco.outer_steps == 1
    moved = [p.detach() for p in model.parameters()]
    assert not any(torch.equal(a, b) for a, b in zip(trained, moved, strict=True))
    anchors = state["anchor"]
    assert any(torch.equal(a, s) for a, s in zip(anchors, start, strict=True))  # fragment 1's


def test_an_in_flight_checkpoint_without_its_participation_loads_as_before():
    """A checkpoint from before fn kept an in-flight exchange's participation, buffers and
    trainable parameters decides them again on load; buffers of other shapes, or parameters
    the model does not have, are refused, nothing changed."""

    def run(edit=None, refused=""):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        diloco = fn.diloco.DiLoCo(model, inner, sync_every=4, delay=1)
        for step in range(3):  # the exchange starts after step 3 and is applied after step 4
            _step(model, inner, step)
        state = diloco.state_dict()
        if edit is not None:
            edit(state)
            diloco.close()
            fresh = fn.diloco.DiLoCo(model, inner, sync_every=4, delay=1)
            before = [a.clone() for a in fresh.state_dict()["anchor"]]
            with pytest.raises(ValueError, match=refused):
                fresh.load_state_dict(state)
            assert all(
                torch.equal(a, b) for a, b in zip(fresh.state_dict()["anchor"], before, strict=True)
            )
            return None
        diloco.close()
        resumed = fn.diloco.DiLoCo(model, inner, sync_every=4, delay=1)
        own = state["per_rank"]["rank0"]
        assert own["in_flight_takes_part"].dtype == torch.bool
        del own["in_flight_takes_part"], own["in_flight_buffers"], state["in_flight"]["trainable"]
        resumed.load_state_dict(state)
        _step(model, inner, 3)
        return resumed.outer_steps, [b.clone() for b in model.buffers()]

    outer_steps, buffers = run()
    assert outer_steps == 1 and all(bool(b.isfinite().all()) for b in buffers)
    run(lambda state: state["per_rank"]["rank0"]["in_flight_buffers"].pop(), "other shapes")
    run(lambda state: state["in_flight"]["trainable"].append(9), r"positions \[0, 1, 2, 3, 9\]")
