"""One Adam step: fn.adam (eager and torch.compile'd) vs torch.optim.Adam(foreach=True).

The params are the layer shapes of a small transformer language model (token embedding, then per
block: fused QKV, attention output, two MLP matrices, biases and two layer norms), about 10.5M
fp32 values with the defaults. One step is, for fn::

    updates, state = tx.update(grads, state, params)
    params = fn.apply_updates(params, updates)

and for torch ``opt.step()`` with the same gradients in ``.grad``. All start from the same
params and see the same fixed gradients. The methods are interleaved in every repeat (so load
changes hit all of them alike); the time printed is the median over the repeats after the
warmup steps, and the ratio is time / the time of ``torch.optim.Adam(foreach=True)`` (lower is
better; the target for fn eager is <= 1.2); "vs fused" is time / the time of
``torch.optim.Adam(fused=True)``, the second reference. fn eager uses its kernel on copies of the
state; "fn.adam eager donated" runs it with buffer donation (``update(..., donate=True)`` in place
on the state, the update written into the gradients' tensors, ``apply_updates(...,
donate=True)``; the gradients are copied back into their tensors before each step, untimed, as a
backward pass writes them); "fn.adam update_and_apply" runs ``fn.update_and_apply(tx, grads,
state, params)`` (the same values; the fused kernel writes the params and the state in place,
the gradients are only read): the target for these two is "vs fused" <= 1.2. After the run fn
eager's params are compared with fused Adam's bit for bit (the lr, 2^-10, is exact in fp32 as fn
stores it) and with foreach Adam's (max abs difference), and the last two runs' with fn eager's
(bit for bit). ``--adamw`` times AdamW instead; its update_and_apply is then compared with
``torch.optim.AdamW(fused=True)``, whose kernel it runs on the params.

Run: python3 benchmarks/optimizer_step.py [--repeats 30] [--warmup 5] [--no-compile] [--adamw]
     python3 benchmarks/optimizer_step.py --vocab 64 --d-model 16 --layers 1 --repeats 2  (tiny)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fn  # noqa: E402


def layer_shapes(vocab: int, d_model: int, layers: int) -> dict[str, tuple[int, ...]]:
    """Param shapes of a GPT-style model: embedding, ``layers`` blocks, final layer norm."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d_model)}
    for i in range(layers):
        block = {
            "ln1.weight": (d_model,),
            "ln1.bias": (d_model,),
            "attn.qkv.weight": (3 * d_model, d_model),
            "attn.qkv.bias": (3 * d_model,),
            "attn.out.weight": (d_model, d_model),
            "attn.out.bias": (d_model,),
            "ln2.weight": (d_model,),
            "ln2.bias": (d_model,),
            "mlp.up.weight": (4 * d_model, d_model),
            "mlp.up.bias": (4 * d_model,),
            "mlp.down.weight": (d_model, 4 * d_model),
            "mlp.down.bias": (d_model,),
        }
        shapes.update({f"blocks.{i}.{k}": v for k, v in block.items()})
    shapes["ln_f.weight"] = (d_model,)
    shapes["ln_f.bias"] = (d_model,)
    return shapes


def make_steppers(
    shapes: dict[str, tuple[int, ...]], lr: float, compile_fn: bool, adamw: bool
) -> dict[str, tuple[Callable[[], None], Callable[[], dict[str, torch.Tensor]]]]:
    """``name -> (step, current params[, untimed preparation before each step])``: torch foreach
    and fused, fn eager, fn compiled, fn eager donated and fn.update_and_apply (the last two)."""
    gen = torch.Generator().manual_seed(0)
    params0 = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=gen) * 1e-3 for k, s in shapes.items()}
    torch_cls, fn_factory = (torch.optim.AdamW, fn.adamw) if adamw else (torch.optim.Adam, fn.adam)

    steppers = {}
    for kind in ("foreach", "fused"):
        torch_params = [p.clone().requires_grad_(True) for p in params0.values()]
        for p, g in zip(torch_params, grads.values(), strict=True):
            p.grad = g.clone()
        opt = torch_cls(torch_params, lr=lr, **{kind: True})
        steppers[f"torch.optim.{torch_cls.__name__}({kind}=True)"] = (
            opt.step,
            lambda ps=torch_params: dict(zip(shapes, (p.detach() for p in ps), strict=True)),
        )

    tx = fn_factory(lr=lr)

    def fn_step(params, state):
        updates, state = tx.update(grads, state, params)
        return fn.apply_updates(params, updates), state

    variants = [(f"fn.{fn_factory.__name__} eager", fn_step)]
    if compile_fn:
        variants.append((f"fn.{fn_factory.__name__} torch.compile", torch.compile(fn_step)))
    for name, step_fn in variants:
        box = {"params": {k: p.clone() for k, p in params0.items()}}
        box["state"] = tx.init(box["params"])

        def step(box=box, step_fn=step_fn):
            box["params"], box["state"] = step_fn(box["params"], box["state"])

        steppers[name] = (step, lambda box=box: box["params"])

    # Donated: the update writes into the state and the gradients' tensors, apply_updates into
    # the params; update_and_apply writes the state and the params (the gradients are only read).
    # The gradients are copied into their (donated) buffers before each timed step, untimed, as
    # a backward pass would write them.
    def donated_step(box):
        updates, box["state"] = tx.update(box["grads"], box["state"], box["params"], donate=True)
        fn.apply_updates(box["params"], updates, donate=True)

    def fused_apply_step(box):
        box["params"], box["state"] = fn.update_and_apply(
            tx, box["grads"], box["state"], box["params"]
        )

    for name, step_fn in (("eager donated", donated_step), ("update_and_apply", fused_apply_step)):
        box = {"params": {k: p.clone() for k, p in params0.items()}}
        box["state"] = tx.init(box["params"])
        box["grads"] = {k: g.clone() for k, g in grads.items()}

        def refill(box=box):
            torch._foreach_copy_(list(box["grads"].values()), list(grads.values()))

        steppers[f"fn.{fn_factory.__name__} {name}"] = (
            lambda box=box, step_fn=step_fn: step_fn(box),
            lambda box=box: box["params"],
            refill,
        )
    return steppers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8192, help="embedding rows")
    parser.add_argument("--d-model", type=int, default=512, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per method first")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd step")
    parser.add_argument("--adamw", action="store_true", help="AdamW (weight decay 0.01)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    shapes = layer_shapes(args.vocab, args.d_model, args.layers)
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    name = "AdamW" if args.adamw else "Adam"
    print(
        f"{name} step on {numel / 1e6:.2f}M fp32 params in {len(shapes)} tensors, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    steppers = make_steppers(shapes, 2.0**-10, not args.no_compile, args.adamw)
    for step, _, *refill in steppers.values():
        for _ in range(args.warmup):
            for prepare in refill:
                prepare()
            step()
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(args.repeats):
        for name, (step, _, *refill) in steppers.items():
            for prepare in refill:
                prepare()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)

    base_name, fused_name, eager_name = list(steppers)[:3]
    base = statistics.median(times[base_name])
    fused = statistics.median(times[fused_name])
    print(f"median of {args.repeats} steps after {args.warmup} warmup steps; ratio = time / the")
    print(f"time of {base_name}; vs fused: time / the time of {fused_name}:")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"  {name:34s} {1e3 * t:8.2f} ms   ratio {t / base:5.2f}   vs fused {t / fused:5.2f}")
    got = steppers[eager_name][1]()
    print(f"params of {eager_name} after {args.warmup + args.repeats} steps vs")
    for name in (base_name, fused_name):
        ref = steppers[name][1]()
        diff = max((ref[k] - got[k]).abs().max().item() for k in shapes)
        same = all(torch.equal(ref[k], got[k]) for k in shapes)
        print(f"  {name:34s} max |difference| {diff:.3g}, bit-identical: {same}")
    donated_name, apply_name = list(steppers)[-2:]
    # fn.adamw's fast step is torch.optim.AdamW(fused=True)'s (see fn.update_and_apply)
    apply_ref = fused_name if args.adamw else eager_name
    for name, ref_name in ((donated_name, eager_name), (apply_name, apply_ref)):
        ref, donated = steppers[ref_name][1](), steppers[name][1]()
        same = all(torch.equal(donated[k], ref[k]) for k in shapes)
        print(f"params of {name} equal to {ref_name}'s bit for bit: {same}")


if __name__ == "__main__":
    main()
