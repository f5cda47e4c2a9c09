"""What the example scripts share: their arguments, their models and data, a training loop, and a
check that every rank ends with the same params.

The scripts in the repository's ``examples/`` folder are not part of the installed package. Each
runs alone: downloaded into an empty folder, with fn installed (and the extras the script names),
``torchrun --standalone --nproc-per-node 2 fsdp_onebit.py`` imports only installed packages.
The plumbing they have in common lives here, so that a script keeps what it is there to show:
the optimizer, the glue to its training stack, its loop. docs/examples.md lists the scripts and
the command that runs each.

- Hugging Face Trainer, Accelerate and Lightning scripts: :func:`parse_stack_args`;
- Trainer and Accelerate: :func:`tiny_gpt2` (it imports transformers, the ``integrations``
  extra) and :class:`SyntheticTokens`;
- Lightning: :class:`ClassifierMixin` (:func:`classifier_net`), :func:`synthetic_data`,
  :class:`ResumableBatches`,
  :func:`trainer_settings` and :func:`checkpoint_settings` (plain values: this module never
  imports lightning);
- FSDP2 and HSDP: :class:`Transformer` on a bigram chain (:func:`bigram_table`,
  :func:`train_batch`, :func:`held_out_loss`), :func:`sharded_transformer`,
  :func:`onebit_parser`, :func:`parse_fsdp_args` and :func:`train`;
- every script: :func:`check_ranks_agree`.

The library (every package of fn but the demo application) never imports this module.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fn.fsdp import TrainingCheckpoint

__all__ = [
    "GPT2_VOCAB",
    "GPT2_CONTEXT",
    "TOKEN_SEQUENCES",
    "FEATURES",
    "CLASSES",
    "SAMPLES",
    "positive_int",
    "freeze_step_arg",
    "parse_stack_args",
    "check_ranks_agree",
    "tiny_gpt2",
    "SyntheticTokens",
    "classifier_net",
    "ClassifierMixin",
    "synthetic_data",
    "ResumableBatches",
    "trainer_settings",
    "checkpoint_settings",
    "Block",
    "Transformer",
    "bigram_table",
    "bigram_tokens",
    "lm_loss",
    "train_batch",
    "held_out_loss",
    "sharded_transformer",
    "onebit_parser",
    "parse_fsdp_args",
    "train",
]

GPT2_VOCAB = 128
"""The vocabulary of :func:`tiny_gpt2` and :class:`SyntheticTokens`."""
GPT2_CONTEXT = 16
"""The positions of :func:`tiny_gpt2`, the length of a :class:`SyntheticTokens` sequence."""
TOKEN_SEQUENCES = 512
"""The sequences of a :class:`SyntheticTokens` data set."""
FEATURES = 16
"""The inputs of :func:`classifier_net` and :func:`synthetic_data`."""
CLASSES = 4
"""The classes of :func:`classifier_net` and :func:`synthetic_data`."""
SAMPLES = 64
"""The rows of :func:`synthetic_data`."""


# -- Arguments of the Trainer, Accelerate and Lightning scripts --------------------------------


def positive_int(text: str) -> int:
    """An argument that counts something (steps, sizes, an interval): an integer of at least 1.

    Args:
        text: the command line's word.

    Returns:
        The integer.

    Raises:
        argparse.ArgumentTypeError: ``text`` is not an integer, or is below 1 (argparse then
            exits with status 2, naming the flag).

    Example:
        >>> positive_int("10")
        10
        >>> positive_int("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be a positive integer, got 0
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def freeze_step_arg(text: str) -> int | str:
    """``--freeze-step``'s value.

    Args:
        text: the command line's word.

    Returns:
        ``"auto"`` as is, anything else as an int.

    Example:
        >>> freeze_step_arg("auto"), freeze_step_arg("10")
        ('auto', 10)
    """
    return text if text == "auto" else int(text)


def parse_stack_args(
    description: str, resume_flag: str, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """The arguments of the Trainer, Accelerate and Lightning scripts: ``--output-dir``
    (required), ``--max-steps`` (40), ``--freeze-step`` (10, or ``auto``), ``--save-steps``
    (20), ``--lr`` (1e-3), ``--batch-size`` (4, per rank) and the stack's resume flag.

    Args:
        description: the script's ``--help`` text.
        resume_flag: ``"--resume"`` (a switch: resume from the newest checkpoint), or a flag
            that takes the checkpoint to resume from (``"--ckpt-path"``).
        argv: the arguments; ``sys.argv[1:]`` if None.

    Returns:
        The parsed arguments.

    Example:
        >>> args = parse_stack_args("a Trainer script", "--ckpt-path", ["--output-dir", "out"])
        >>> args.max_steps, args.freeze_step, args.ckpt_path
        (40, 10, None)
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=positive_int, default=40)
    parser.add_argument(
        "--freeze-step",
        type=freeze_step_arg,
        default=10,
        help='1-bit Adam\'s warmup updates, or "auto" to let the warmup decide',
    )
    parser.add_argument(
        "--save-steps", type=positive_int, default=20, help="checkpoint every N steps"
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=positive_int, default=4, help="per rank")
    if resume_flag == "--resume":
        parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    else:
        parser.add_argument(resume_flag, default=None, help="the checkpoint to resume from")
    return parser.parse_args(argv)


def check_ranks_agree(model: nn.Module) -> str:
    """Checks that every rank holds the same params; rank 0 prints their digest.

    A collective when ``torch.distributed`` is initialized: sharded params (``DTensor``) are
    all-gathered and the digests compared across the ranks.

    Args:
        model: the trained model, the same on every rank.

    Returns:
        The SHA-256 of the params (names and bytes, in name order), in hex.

    Raises:
        RuntimeError: the ranks hold different params.

    Example:
        >>> digest = check_ranks_agree(torch.nn.Linear(2, 1))
        final params sha256 ... (the same on every rank)
    """
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if isinstance(p, DTensor):
            p = p.full_tensor()
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    mine = digest.hexdigest()
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if len(set(every)) != 1:
            raise RuntimeError(f"the ranks ended with different params: {every}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"final params sha256 {mine} (the same on every rank)")
    return mine


# -- The Trainer and Accelerate scripts' model and data ----------------------------------------


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """A 2-layer GPT-2 (about 30k params) with random weights, the same on every rank.

    Dropout is off, so that a run does not depend on the random state of the training stack.
    Imports transformers (the ``integrations`` extra).

    Args:
        seed: the seed of the weights (``torch.manual_seed``).

    Returns:
        A ``transformers.GPT2LMHeadModel`` of :data:`GPT2_VOCAB` tokens and
        :data:`GPT2_CONTEXT` positions.

    Example:
        >>> model = tiny_gpt2()
        >>> batch = SyntheticTokens()[0]
        >>> loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
        >>> loss.shape
        torch.Size([])
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    no_dropout = {f"{part}_pdrop": 0.0 for part in ("resid", "embd", "attn")}  # runs repeat
    shape = {"n_embd": 32, "n_layer": 2, "n_head": 2}
    # GPT-2's bos/eos ids (50256) lie outside this vocabulary; they only configure generation
    tokens = {"bos_token_id": GPT2_VOCAB - 1, "eos_token_id": GPT2_VOCAB - 1}
    config = GPT2Config(
        vocab_size=GPT2_VOCAB, n_positions=GPT2_CONTEXT, **shape, **no_dropout, **tokens
    )
    return GPT2LMHeadModel(config)


class SyntheticTokens(torch.utils.data.Dataset):
    """:data:`TOKEN_SEQUENCES` fixed token sequences of :data:`GPT2_CONTEXT` tokens: a
    repeating pattern with 20 % of the tokens random, so that the loss can fall.

    Args:
        seed: the seed of the random tokens; another seed gives held-out sequences of the same
            kind.

    Attributes:
        tokens: the ``[TOKEN_SEQUENCES, GPT2_CONTEXT]`` int64 token ids.

    Example:
        >>> data = SyntheticTokens()
        >>> len(data), data[0]["input_ids"].shape, bool((data[0]["labels"] == data.tokens[0]).all())
        (512, torch.Size([16]), True)
    """

    def __init__(self, seed: int = 1) -> None:
        gen = torch.Generator().manual_seed(seed)
        pattern = torch.arange(GPT2_CONTEXT) % 7
        noise = torch.randint(0, GPT2_VOCAB, (TOKEN_SEQUENCES, GPT2_CONTEXT), generator=gen)
        keep = torch.rand(TOKEN_SEQUENCES, GPT2_CONTEXT, generator=gen) < 0.8
        self.tokens = torch.where(keep, pattern, noise)

    def __len__(self) -> int:
        return TOKEN_SEQUENCES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


# -- The Lightning scripts' model, data and Trainer settings -----------------------------------


def classifier_net(seed: int = 0) -> nn.Sequential:
    """A 2-layer MLP (about 1.3k params) with random weights, the same on every rank.

    Args:
        seed: the seed of the weights (``torch.manual_seed``).

    Returns:
        ``Linear(FEATURES, 64), Tanh(), Linear(64, CLASSES)``.

    Example:
        >>> classifier_net()(torch.zeros(3, FEATURES)).shape
        torch.Size([3, 4])
    """
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, CLASSES))


class ClassifierMixin:
    """The Lightning scripts' classifier, mixed into a ``lightning.LightningModule`` (this module
    never imports lightning): the :func:`classifier_net` as ``self.net`` and the training step's
    loss, the cross-entropy on a batch of :func:`synthetic_data`. The script adds the optimizer
    (``configure_optimizers``) and, with FSDP2, the sharding (``configure_model``).

    Args:
        lr: the learning rate, kept as ``self.lr`` for ``configure_optimizers``.
        freeze_step: the 1-bit optimizers' ``freeze_step``, kept as ``self.freeze_step``.
        seed: the seed of the weights, the same on every rank.

    Example:
        >>> class Classifier(ClassifierMixin, torch.nn.Module):  # lightning.LightningModule
        ...     pass
        >>> model = Classifier(lr=1e-3, freeze_step=10)
        >>> model.training_step(synthetic_data(), batch_idx=0).shape
        torch.Size([])
    """

    def __init__(self, lr: float, freeze_step: int | str, seed: int = 0) -> None:
        super().__init__()
        self.net = classifier_net(seed)
        self.lr, self.freeze_step = lr, freeze_step

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        """The loss of ``self.net`` on ``batch``, ``(x, y)``."""
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def synthetic_data(samples: int = SAMPLES, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random inputs and the labels a random linear teacher gives them.

    Args:
        samples: the number of rows.
        seed: the seed of the inputs and the teacher.

    Returns:
        ``(x, y)``: ``[samples, FEATURES]`` floats and ``[samples]`` class ids.

    Example:
        >>> x, y = synthetic_data()
        >>> x.shape, y.shape, int(y.max()) < CLASSES
        (torch.Size([64, 16]), torch.Size([64]), True)
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=gen)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    return x, (x @ teacher).argmax(dim=1)


class ResumableBatches:
    """This rank's batches of ``(x, y)``, a data loader that Lightning can resume mid-epoch.

    Each epoch is a permutation of the rows drawn from the epoch's number, cut into batches of
    ``batch_size`` per rank and dealt round the ranks. Its position (epoch, batch) goes into
    Lightning's checkpoints (``state_dict``), so a run resumed in the middle of an epoch
    continues with the next batch; Lightning restarts a plain ``DataLoader``'s epoch from its
    first batch instead. Use it with ``Trainer(use_distributed_sampler=False)``.

    Args:
        x: the inputs, a row per sample.
        y: the labels.
        batch_size: rows per batch and rank.
        rank: this rank.
        ranks: the number of ranks.

    Example:
        >>> batches = ResumableBatches(*synthetic_data(), batch_size=4, rank=0, ranks=2)
        >>> len(batches), next(iter(batches))[0].shape
        (8, torch.Size([4, 16]))
        >>> batches.state_dict()
        {'epoch': 0, 'position': 1}
    """

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int, ranks: int
    ) -> None:
        self.x, self.y, self.batch_size, self.rank, self.ranks = x, y, batch_size, rank, ranks
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        return len(self.x) // (self.batch_size * self.ranks)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        while self.position < len(self):
            start = (self.position * self.ranks + self.rank) * self.batch_size
            rows = order[start : start + self.batch_size]
            self.position += 1
            yield self.x[rows], self.y[rows]
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch", "position"}`` (the next batch of that epoch)."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues from a :meth:`state_dict`."""
        self.epoch, self.position = state["epoch"], state["position"]


def trainer_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The Lightning scripts' ``lightning.Trainer`` settings besides the strategy and the
    callbacks.

    One GPU per rank where there are GPUs, else the CPU (gloo); ``torchrun``'s ranks per node,
    or 2 (Lightning then starts the second process itself); ``args.max_steps`` updates; the
    batches dealt by :class:`ResumableBatches`, not by a distributed sampler; deterministic;
    no logger, progress bar or model summary.

    Args:
        args: :func:`parse_stack_args`'s arguments.

    Returns:
        ``lightning.Trainer``'s keyword arguments.

    Example:
        >>> args = parse_stack_args("", "--ckpt-path", ["--output-dir", "out", "--max-steps", "8"])
        >>> trainer_settings(args)["max_steps"]
        8
    """
    return {
        "accelerator": "gpu" if torch.cuda.is_available() else "cpu",
        "devices": int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
        "max_steps": args.max_steps,
        "use_distributed_sampler": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "deterministic": True,
    }


def checkpoint_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The Lightning scripts' ``ModelCheckpoint`` settings: every ``args.save_steps`` updates,
    ``args.output_dir/checkpoint-S.ckpt`` for update ``S``, every one kept.

    Args:
        args: :func:`parse_stack_args`'s arguments.

    Returns:
        ``lightning.pytorch.callbacks.ModelCheckpoint``'s keyword arguments.

    Example:
        >>> args = parse_stack_args("", "--ckpt-path", ["--output-dir", "out"])
        >>> checkpoint_settings(args)["every_n_train_steps"]
        20
    """
    return {
        "dirpath": args.output_dir,
        "filename": "checkpoint-{step}",
        "auto_insert_metric_name": False,
        "every_n_train_steps": args.save_steps,
        "save_top_k": -1,
    }


# -- The FSDP2 and HSDP scripts' model, data, arguments and loop -------------------------------


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP.

    Args:
        d_model: the width.
        heads: the attention heads.

    Example:
        >>> Block(8, 2)(torch.zeros(1, 3, 8)).shape
        torch.Size([1, 3, 8])
    """

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``[batch, length, d_model]``) through the block."""
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """A causal language model: token and position embeddings, ``layers`` :class:`Block` s, a
    final norm and a vocabulary head.

    Args:
        vocab: the vocabulary.
        d_model: the width.
        heads: the attention heads per block.
        layers: the blocks.
        context: the longest sequence.

    Example:
        >>> model = Transformer(vocab=16, d_model=8, heads=2, layers=1, context=4)
        >>> model(torch.zeros(2, 4, dtype=torch.int64)).shape
        torch.Size([8, 16])
    """

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.randn(context, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[batch * length, vocab]`` logits of ``[batch, length]`` tokens (a new tensor:
        FSDP2 warns about returned views)."""
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).flatten(0, 1))


def bigram_table(vocab: int, seed: int = 0) -> torch.Tensor:
    """A fixed random next-token distribution per token, peaked: a few likely successors.

    Args:
        vocab: the vocabulary.
        seed: the seed of the table.

    Returns:
        ``[vocab, vocab]`` probabilities, a row per token.

    Example:
        >>> table = bigram_table(16)
        >>> table.shape, bool(torch.allclose(table.sum(dim=1), torch.ones(16)))
        (torch.Size([16, 16]), True)
    """
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(vocab, vocab, generator=g), dim=1)


def bigram_tokens(table: torch.Tensor, batch: int, length: int, seed: int) -> torch.Tensor:
    """Token sequences drawn from the bigram chain ``table``.

    Args:
        table: :func:`bigram_table`'s probabilities.
        batch: the sequences.
        length: the tokens per sequence.
        seed: the seed of the draw.

    Returns:
        ``[batch, length]`` int64 token ids.

    Example:
        >>> bigram_tokens(bigram_table(16), batch=2, length=5, seed=0).shape
        torch.Size([2, 5])
    """
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(batch, length, dtype=torch.int64)
    out[:, 0] = torch.randint(table.shape[0], (batch,), generator=g)
    for i in range(1, length):
        out[:, i] = torch.multinomial(table[out[:, i - 1]], 1, generator=g).squeeze(1)
    return out


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy of :class:`Transformer` ``model`` on ``batch``.

    Args:
        model: the model.
        batch: ``[batch, length + 1]`` tokens; the model reads the first ``length``.

    Returns:
        The mean loss, a scalar.

    Example:
        >>> model = Transformer(vocab=16, d_model=8, heads=2, layers=1, context=4)
        >>> lm_loss(model, bigram_tokens(bigram_table(16), 2, 5, seed=0)).shape
        torch.Size([])
    """
    return nn.functional.cross_entropy(model(batch[:, :-1]), batch[:, 1:].flatten())


def train_batch(
    table: torch.Tensor, args: argparse.Namespace, step: int, rank: int
) -> torch.Tensor:
    """The batch of ``rank`` at ``step``: its own ``args.batch`` sequences of
    ``args.context + 1`` tokens, the same in every run.

    Args:
        table: :func:`bigram_table`'s probabilities.
        args: :func:`parse_fsdp_args`'s arguments.
        step: the update, from 0.
        rank: the rank whose data it is.

    Returns:
        ``[args.batch, args.context + 1]`` tokens.

    Example:
        >>> args = parse_fsdp_args(argparse.ArgumentParser(), [])
        >>> train_batch(bigram_table(args.vocab), args, step=0, rank=1).shape
        torch.Size([8, 33])
    """
    return bigram_tokens(table, args.batch, args.context + 1, seed=1_000_003 * (step + 1) + rank)


@torch.no_grad()
def held_out_loss(model: nn.Module, table: torch.Tensor, args: argparse.Namespace) -> float:
    """The loss on fixed held-out sequences, the same on every rank and never trained on.

    Args:
        model: the model.
        table: :func:`bigram_table`'s probabilities.
        args: :func:`parse_fsdp_args`'s arguments (``4 * args.batch`` sequences).

    Returns:
        The mean loss.

    Example:
        >>> args = parse_fsdp_args(argparse.ArgumentParser(), ["--vocab", "16", "--context", "4"])
        >>> model = Transformer(args.vocab, 8, 2, 1, args.context)
        >>> held_out_loss(model, bigram_table(args.vocab), args) > 0
        True
    """
    batch = bigram_tokens(table, 4 * args.batch, args.context + 1, seed=-1 % 2**31)
    return float(lm_loss(model, batch))


def sharded_transformer(args: argparse.Namespace, mesh: DeviceMesh) -> nn.Module:
    """The :class:`Transformer` of ``args``, every block and the root an FSDP2 module.

    The weights are drawn from ``args.seed``: the same on every rank.

    Args:
        args: :func:`parse_fsdp_args`'s arguments.
        mesh: the 1-D mesh to shard over (HSDP: the mesh of the node's ranks).

    Returns:
        The sharded model.

    Example:
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> args = parse_fsdp_args(argparse.ArgumentParser(), [])
        >>> model = sharded_transformer(args, init_device_mesh("cpu", (1,)))
        >>> dist.destroy_process_group()
    """
    torch.manual_seed(args.seed)
    model = Transformer(args.vocab, args.d_model, args.heads, args.layers, args.context)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def onebit_parser(description: str) -> argparse.ArgumentParser:
    """The 1-bit FSDP2 and HSDP scripts' own arguments: ``--max-steps`` (40), ``--freeze-step``
    (10, or ``auto``) and ``--optimizer`` (``adam`` or ``lamb``).

    Args:
        description: the script's ``--help`` text.

    Returns:
        The parser; :func:`parse_fsdp_args` adds the rest and parses.

    Example:
        >>> args = parse_fsdp_args(onebit_parser("a 1-bit script"), ["--optimizer", "lamb"])
        >>> args.optimizer, args.freeze_step, args.max_steps
        ('lamb', 10, 40)
    """
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--max-steps", type=positive_int, default=40)
    p.add_argument(
        "--freeze-step", type=freeze_step_arg, default=10, help='first compressed update, or "auto"'
    )
    p.add_argument("--optimizer", choices=("adam", "lamb"), default="adam")
    return p


def parse_fsdp_args(
    p: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Adds the FSDP2 and HSDP scripts' shared arguments to ``p`` and parses ``argv``.

    The model (``--vocab`` 64, ``--d-model`` 64, ``--heads`` 4, ``--layers`` 2,
    ``--context`` 32), the data (``--batch`` 8 sequences per rank and step), the training
    (``--lr`` 3e-3, ``--seed`` 0, ``--log-every`` 10) and the checkpoints (``--checkpoint DIR``,
    saved at the end; ``--resume`` continues it).

    Args:
        p: the parser with the script's own arguments.
        argv: the arguments; ``sys.argv[1:]`` if None.

    Returns:
        The parsed arguments.

    Example:
        >>> args = parse_fsdp_args(argparse.ArgumentParser(), ["--layers", "1"])
        >>> args.layers, args.d_model, args.checkpoint
        (1, 64, None)
    """
    p.add_argument("--vocab", type=positive_int, default=64)
    p.add_argument("--d-model", type=positive_int, default=64)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--context", type=positive_int, default=32)
    p.add_argument("--batch", type=positive_int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=positive_int, default=10)
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (saved at the end)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint")
    return args


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpoint: TrainingCheckpoint,
    args: argparse.Namespace,
    rank: int,
) -> float:
    """Trains from update ``checkpoint.step`` to ``args.max_steps`` on :func:`train_batch`'s
    batches, setting ``checkpoint.step`` after each; rank 0 prints the loss every
    ``args.log_every`` updates.

    Args:
        model: the model, a :class:`Transformer`.
        optimizer: its optimizer.
        checkpoint: the checkpoint of the run (a loaded one resumes at its step).
        args: :func:`parse_fsdp_args`'s arguments.
        rank: this rank, which picks its data.

    Returns:
        The :func:`held_out_loss` at the end.

    Example:
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> args = parse_fsdp_args(argparse.ArgumentParser(), ["--layers", "1"])
        >>> args.max_steps, args.log_every = 2, 1
        >>> model = sharded_transformer(args, init_device_mesh("cpu", (1,)))
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        >>> checkpoint = TrainingCheckpoint(model, optimizer)
        >>> final = train(model, optimizer, checkpoint, args, rank=0)
        step 1: train loss ...
        step 2: train loss ...
        >>> checkpoint.step
        2
        >>> dist.destroy_process_group()
    """
    table = bigram_table(args.vocab)
    for step in range(checkpoint.step, args.max_steps):
        optimizer.zero_grad()
        loss = lm_loss(model, train_batch(table, args, step, rank))
        loss.backward()
        optimizer.step()
        checkpoint.step = step + 1
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}: train loss {float(loss.detach()):.4f}", flush=True)
    return held_out_loss(model, table, args)
