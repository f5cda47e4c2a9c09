"""The safeguard against near-zero frozen variance (``safeguard=True``, the default): models with
dead units and unused embedding rows train with the default betas and eps, where DeepSpeed's
rule (``safeguard=False``) blows up; the freeze reports a count once (a warning only where
training is at risk); a compressed update on a state that never warmed up is an error."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import fn
from fn.collectives import Local, Simulated, replicate, simulate
from fn.transforms._leafwise import adam_ratio_bound

WORLD = 2
FACTORIES = {
    "onebit_adam": lambda lr, freeze, comm, **kw: fn.onebit_adam(lr, freeze, comm=comm, **kw),
    "zero_one_adam": lambda lr, freeze, comm, **kw: fn.zero_one_adam(
        lr, var_freeze_step=freeze, comm=comm, **kw
    ),
    "onebit_lamb": lambda lr, freeze, comm, **kw: fn.onebit_lamb(lr, freeze, comm=comm, **kw),
}


def relu_mlp():
    """The 16-64-64-4 ReLU MLP of the issue, regressing a small tanh teacher network."""
    gen = torch.Generator().manual_seed(0)
    params = {}
    for k, (i, o) in enumerate([(16, 64), (64, 64), (64, 4)]):
        params[f"w{k}"] = torch.randn(i, o, generator=gen) * i**-0.5
        params[f"b{k}"] = torch.zeros(o)
    teacher = torch.randn(16, 32, generator=gen) * 0.25, torch.randn(32, 4, generator=gen) * 0.18

    def batch(gen):
        x = torch.randn(WORLD, 32, 16, generator=gen)
        return x, torch.tanh(x @ teacher[0]) @ teacher[1]

    def loss(p, x, y):
        h = torch.relu(x @ p["w0"] + p["b0"])
        h = torch.relu(h @ p["w1"] + p["b1"])
        return torch.nn.functional.mse_loss(h @ p["w2"] + p["b2"], y)

    return params, loss, batch


VOCAB, CONTEXT, POSITIONS, WIDTH = 16, 8, 32, 32


def tiny_gpt():
    """A GPT-2-style block (token and position embeddings, causal attention, GELU MLP, layer
    norms) trained on sequences of 7 tokens: position rows 7..31 never get a gradient."""
    gen = torch.Generator().manual_seed(0)

    def normal(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    params = {
        "tok": normal(VOCAB, WIDTH),
        "pos": normal(POSITIONS, WIDTH),
        "ln1": torch.ones(WIDTH),
        "qkv": normal(WIDTH, 3 * WIDTH),
        "proj": normal(WIDTH, WIDTH),
        "ln2": torch.ones(WIDTH),
        "fc": normal(WIDTH, 4 * WIDTH),
        "fc_b": torch.zeros(4 * WIDTH),
        "out": normal(4 * WIDTH, WIDTH),
        "head": normal(WIDTH, VOCAB),
    }

    def batch(gen):  # x_{i+1} = (x_i + x_{i-1}) mod VOCAB
        cols = list(torch.randint(0, VOCAB, (2, WORLD, 32), generator=gen))
        for _ in range(CONTEXT - 1):
            cols.append((cols[-1] + cols[-2]) % VOCAB)
        seq = torch.stack(cols, -1)
        return seq[..., :-1], seq[..., 1:]

    def loss(p, x, y):
        norm = torch.nn.functional.layer_norm
        h = p["tok"][x] + p["pos"][: x.shape[-1]]
        q, k, v = (norm(h, (WIDTH,), p["ln1"]) @ p["qkv"]).split(WIDTH, -1)
        h = (
            h
            + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) @ p["proj"]
        )
        a = norm(h, (WIDTH,), p["ln2"])
        h = h + torch.nn.functional.gelu(a @ p["fc"] + p["fc_b"]) @ p["out"]
        logits = h @ p["head"]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    return params, loss, batch


def train(make_opt, model, steps):
    """``steps`` updates of ``make_opt(comm)`` on 2 simulated ranks: the params (rank 0) and the
    largest param change of any update (inf if the run hit non-finite values)."""
    init, loss, batch = model
    comm = Simulated(WORLD)
    opt = make_opt(comm)
    params, state = replicate(init, comm), replicate(opt.init(init), comm)

    def step_fn(params, state, x, y, *, step):
        grads = torch.func.grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params, step=step)
        return fn.apply_updates(params, updates), state

    step = simulate(step_fn, comm)
    gen = torch.Generator().manual_seed(1)
    largest = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for t in range(1, steps + 1):
            try:
                new = step(params, state, *batch(gen), step=t)
            except ValueError as err:  # a non-finite gradient or momentum
                assert "non-finite" in str(err)
                return {k: p[0] for k, p in params.items()}, float("inf")
            change = max(float((new[0][k] - params[k]).abs().max()) for k in params)
            params, state = new
            largest = max(largest, change)
    return {k: p[0] for k, p in params.items()}, largest


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("model", [relu_mlp, tiny_gpt])
def test_default_hyperparameters_train_without_blowing_up(name, model):
    """lr 1e-2, freeze 10, default betas and eps. Every update of the compressed Adam rules is
    at most lr * B per element (1-bit LAMB scales its u0 <= B by its trust ratio and factor)."""
    lr, freeze, steps = 1e-2, 10, 30
    problem = model()
    params, largest = train(lambda comm: FACTORIES[name](lr, freeze, comm), problem, steps)
    assert all(torch.isfinite(p).all() for p in params.values())
    bound = adam_ratio_bound(0.9, 0.999)
    if name == "onebit_lamb":  # R <= max_coeff, f <= factor_max
        bound *= 10.0 * 4.0
    assert largest <= lr * bound * (1 + 1e-5)
    if model is tiny_gpt:
        used = CONTEXT - 1
        unused = params["pos"][used:] - problem[0]["pos"][used:]
        assert unused.abs().max() <= lr * bound * (steps - freeze + 1)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam"])
@pytest.mark.parametrize("model", [relu_mlp, tiny_gpt])
def test_deepspeed_rule_blows_up_on_the_same_run(name, model):
    """The run above with ``safeguard=False``: DeepSpeed's rule steps by far more than any
    Adam update (the case the safeguard is for)."""
    make = lambda comm: FACTORIES[name](1e-2, 10, comm, safeguard=False)  # noqa: E731
    _, largest = train(make, model(), 20)
    assert largest > 1e3 * 1e-2 * adam_ratio_bound(0.9, 0.999)


def test_adam_ratio_bound_is_reached_and_never_exceeded():
    """B is the supremum of |m / sqrt(v)| of Adam without bias correction: gradients growing
    like (b2 / b1)^j approach it, random ones stay below."""
    b1, b2 = 0.9, 0.999
    bound = adam_ratio_bound(b1, b2)
    assert bound == pytest.approx(0.1 / (0.001 * (1 - 0.81 / 0.999)) ** 0.5)
    gen = torch.Generator().manual_seed(0)
    for grads in (torch.randn(2000, 64, generator=gen), torch.randn(2000, 64, generator=gen) ** 5):
        m = v = torch.zeros(64, dtype=torch.float64)
        for g in grads.double():
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            assert (m.abs() / v.sqrt()).max() <= bound
    m = v = torch.zeros((), dtype=torch.float64)
    for j in range(3000):
        g = torch.tensor(b2 / b1, dtype=torch.float64) ** j
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    assert float(m / v.sqrt()) == pytest.approx(bound, rel=1e-3)
    assert adam_ratio_bound(0.9, 0.5) == float("inf")


ZEROS_3_OF_8 = torch.tensor([0.5, -1.0, 2.0, 0.0, 0.0, 0.0, 1.0, -0.5])


def _freeze_reports(name, comm, grad=ZEROS_3_OF_8, **kwargs):
    """Warmup on a constant gradient, then two compressed updates: the RuntimeWarnings' and the
    ``fn.transforms`` INFO records' messages."""
    opt = FACTORIES[name](1e-2, 3, comm, **kwargs)
    init = {"w": torch.ones(8)}
    params, state, update = init, opt.init(init), opt.update
    if isinstance(comm, Simulated):
        params, state, update = (
            replicate(init, comm),
            replicate(state, comm),
            simulate(update, comm),
        )
        grad = torch.stack([grad, grad])
    logger = logging.getLogger("fn.transforms")
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for t in range(1, 6):
                updates, state = update({"w": grad}, state, params, step=t)
                params = fn.apply_updates(params, updates)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return warned, [r.getMessage() for r in records if "variance froze" in r.getMessage()]


def _freeze_warnings(name, comm, **kwargs):
    return _freeze_reports(name, comm, **kwargs)[0]


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("comm", [Local(), Simulated(WORLD)], ids=["local", "simulated"])
def test_freeze_warns_once_with_the_count(name, comm):
    messages = _freeze_warnings(name, comm)
    assert len(messages) == 1
    assert f"{name}: the variance froze with 3 of 8 elements at zero" in messages[0]
    assert "bounds their updates" in messages[0]


def test_freeze_warning_names_the_risk_without_the_safeguard():
    (message,) = _freeze_warnings("onebit_adam", Local(), safeguard=False)
    assert "safeguard=False" in message and "blow up" in message


@pytest.mark.parametrize("name", FACTORIES)
def test_freeze_logs_a_few_elements_below_the_range_without_a_warning(name):
    grad = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 0.05])  # one element far below
    warned, logged = _freeze_reports(name, Local(), grad=grad)
    assert warned == []
    assert len(logged) == 1
    assert f"{name}: the variance froze with 0 of 8 elements at zero and 1 below" in logged[0]


def test_freeze_warns_when_a_few_elements_are_below_the_range_without_the_safeguard():
    grad = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 0.05])
    warned, logged = _freeze_reports("onebit_adam", Local(), grad=grad, safeguard=False)
    assert len(warned) == 1 and "0 of 8 elements at zero and 1 below" in warned[0]
    assert logged == []


@pytest.mark.parametrize("name", FACTORIES)
def test_freeze_warns_when_most_elements_are_below_the_range(name):
    grad = torch.tensor([20.0, -0.05, 0.05, 0.05, -0.05, 0.05, -0.05, 0.05])
    warned, logged = _freeze_reports(name, Local(), grad=grad)
    assert len(warned) == 1 and "0 of 8 elements at zero and 7 below" in warned[0]
    assert logged == []


@pytest.mark.parametrize("name", FACTORIES)
def test_freeze_logs_zero_variance_that_exp_avg_mask_never_updates(name):
    mask = {"w": (ZEROS_3_OF_8 != 0).float()}
    warned, logged = _freeze_reports(name, Local(), exp_avg_mask=mask)
    assert warned == []
    assert len(logged) == 1 and "with 0 of 8 elements at zero" in logged[0]


def test_freeze_is_silent_when_every_variance_is_in_range():
    opt = fn.onebit_adam(1e-2, 3, comm=Local())
    params = {"w": torch.ones(4)}
    state = opt.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for t in range(1, 5):
            _, state = opt.update({"w": torch.tensor([1.0, -1.0, 1.0, -1.0])}, state, step=t)


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("comm", [Local(), Simulated(WORLD)], ids=["local", "simulated"])
def test_compressed_update_on_a_state_that_never_warmed_up_raises(name, comm):
    opt = FACTORIES[name](1e-2, 3, comm)
    init = {"w": torch.ones(8)}
    params, state, update = init, opt.init(init), opt.compressed_update
    grads = {"w": torch.linspace(-1.0, 1.0, 8)}
    if isinstance(comm, Simulated):
        params, state = replicate(init, comm), replicate(state, comm)
        update, grads = simulate(update, comm), replicate(grads, comm)
    before = [x.clone() for x in fn.tree.tree_leaves(state)]
    with pytest.raises(ValueError, match=rf"{name}: .*never warmed up \(count 0\)"):
        update(grads, state, params, step=5)
    assert all(torch.equal(a, b) for a, b in zip(before, fn.tree.tree_leaves(state), strict=True))
