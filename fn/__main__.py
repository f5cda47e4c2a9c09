"""``python -m fn``: the command line.

``python -m fn demo`` trains a tiny model with ``fn.adam`` in a custom ``torch.func`` loop and
prints its loss; the full demo (real data, workers, compressed optimizers) is still to come.
"""

from __future__ import annotations

import argparse
import sys

import torch

import fn


def _demo(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(256, 8)
    y = torch.sin(x.sum(dim=1, keepdim=True))

    def loss_fn(p):
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, p, (x,)), y)

    tx = fn.adam(lr=args.lr)
    state = tx.init(params)
    for t in range(1, args.steps + 1):
        grads, loss = torch.func.grad_and_value(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        params = fn.apply_updates(params, updates)
        if t == 1 or t % max(1, args.steps // 10) == 0 or t == args.steps:
            print(f"step {t:5d}  loss {loss.item():.6f}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny model with fn.adam")
    demo.add_argument("--steps", type=int, default=200)
    demo.add_argument("--lr", type=float, default=1e-2)
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
