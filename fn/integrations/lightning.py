"""PyTorch Lightning glue: :class:`FnCallback`.

Example (under ``torchrun``; the full scripts are ``examples/lightning_ddp.py`` and
``examples/lightning_fsdp.py``)::

    class Model(lightning.LightningModule):
        ...
        def configure_optimizers(self):
            return fn.optim.OnebitAdam(self.parameters(), lr=1e-3, freeze_step=100)

    trainer = lightning.Trainer(strategy="ddp", callbacks=[FnCallback()], ...)
    trainer.fit(Model())  # or trainer.fit(Model(), ckpt_path=...): every rank resumes exactly

    class ShardedModel(lightning.LightningModule):
        ...
        def configure_model(self):
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def configure_optimizers(self):
            return fn.fsdp.OnebitAdam(self, lr=1e-3, freeze_step=100)

    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = lightning.Trainer(strategy=strategy, callbacks=[FnCallback()], ...)

On HSDP (sharded inside the node, 1-bit across nodes; :class:`FnCallback` has the recipe), the
strategy is the same, ``data_parallel_size`` the world size; ``configure_model`` builds ``mesh =
init_device_mesh(..., (nodes, ranks per node), mesh_dim_names=("replicate", "shard"))``, shards
on ``mesh["shard"]``, and ``configure_optimizers`` passes ``replicate=mesh["replicate"]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import (
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    Strategy,
)
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.utils.data import DistributedSampler

from fn.collectives import Local, ProcessGroup
from fn.collectives.agreement import agree
from fn.fsdp import ShardedOnebitOptimizer, read_onebit_state
from fn.integrations._common import register_ddp, unwrap_optimizer
from fn.optim import FunctionalOptimizer, OnebitAdam, OnebitFamily, OnebitLamb

__all__ = ["FnCallback", "check_strategy"]

_NAME = "fn.integrations.lightning"

# Strategies that shard or average the gradients themselves, with what to use instead.
_UNSUPPORTED = (
    (
        FSDPStrategy,
        "Lightning's FSDPStrategy shards the params and reduce-scatters the gradients itself",
    ),
    (
        ModelParallelStrategy,
        "Lightning's ModelParallelStrategy (FSDP2 / tensor parallel) shards the params and "
        "reduce-scatters the gradients itself",
    ),
    (DeepSpeedStrategy, "Lightning's DeepSpeedStrategy averages the gradients itself"),
)


def check_strategy(strategy: Any, optimizer: FunctionalOptimizer | ShardedOnebitOptimizer) -> None:
    """Raises unless ``optimizer`` can run under the Lightning ``strategy``.

    ``fn.optim``'s 1-bit family communicates the gradients itself, over whole param groups. Under
    ``strategy="ddp"`` (any ``DDPStrategy``) ``fn.ddp.register`` makes DDP step aside in the
    compressed phase; the sharded strategies (FSDP, FSDP2 via ``ModelParallelStrategy``,
    DeepSpeed) hold only a shard of each param and gradient, for which ``fn.optim`` has no
    1-bit optimizer. ``fn.fsdp.OnebitAdam`` and ``fn.fsdp.OnebitLamb`` are those optimizers
    for FSDP2 (:class:`~fn.fsdp.ShardedOnebitOptimizer`): they run under
    ``ModelParallelStrategy`` (the model's ``configure_model`` applies ``fully_shard``) and
    under no other.

    Args:
        strategy: the trainer's strategy (``trainer.strategy``).
        optimizer: an ``fn.optim`` optimizer or an ``fn.fsdp`` 1-bit optimizer of the run.

    Raises:
        NotImplementedError: a 1-bit family ``fn.optim`` optimizer under a sharded strategy, or
            an ``fn.fsdp`` one under another strategy than ``ModelParallelStrategy``,
            naming what to use instead.

    Example:
        >>> import torch
        >>> from lightning.pytorch.strategies import FSDPStrategy, SingleDeviceStrategy
        >>> from fn.collectives import Local
        >>> opt = fn.optim.OnebitAdam(torch.nn.Linear(2, 1).parameters(), comm=Local())
        >>> check_strategy(SingleDeviceStrategy("cpu"), opt)
        >>> check_strategy(FSDPStrategy(), opt)
        Traceback (most recent call last):
        ...
        NotImplementedError: fn.integrations.lightning: OnebitAdam cannot run under ...
    """
    if isinstance(optimizer, ShardedOnebitOptimizer):
        if not isinstance(strategy, ModelParallelStrategy):
            raise NotImplementedError(
                f"fn.integrations.lightning: {optimizer.name} runs on FSDP2 modules under "
                f"Lightning's ModelParallelStrategy, not under {type(strategy).__name__}: use "
                "Trainer(strategy=ModelParallelStrategy(data_parallel_size=N, "
                "tensor_parallel_size=1)) with fully_shard in configure_model, or "
                "fn.optim.OnebitAdam with strategy='ddp'"
            )
        return
    if not isinstance(optimizer, OnebitFamily):
        return
    for kind, why in _UNSUPPORTED:
        if isinstance(strategy, kind):
            raise NotImplementedError(
                f"fn.integrations.lightning: {type(optimizer).__name__} cannot run under "
                f"{type(strategy).__name__}: {why}, and fn.optim's 1-bit family needs whole "
                "params and local gradients. Use Trainer(strategy='ddp') with it; for a sharded "
                "model, fn.fsdp.OnebitAdam and OnebitLamb run on FSDP2 under "
                "ModelParallelStrategy "
                "(fully_shard in configure_model), and a torch optimizer with "
                "fn.fsdp.loco_reduce_scatter sends 4-bit gradients under any FSDP2 setup"
            )


def _fn_optimizers(
    trainer: Trainer,
) -> list[tuple[int, FunctionalOptimizer | ShardedOnebitOptimizer]]:
    """``(index in trainer.optimizers, optimizer)`` for each of the trainer's ``fn.optim``
    optimizers and ``fn.fsdp`` 1-bit optimizers.

    Raises:
        TypeError: the trainer has none.
    """
    found = []
    for index, optimizer in enumerate(trainer.optimizers):
        if not isinstance(optimizer, ShardedOnebitOptimizer):
            try:
                optimizer = unwrap_optimizer(optimizer)
            except TypeError:
                continue
        found.append((index, optimizer))
    if not found:
        names = [type(o).__name__ for o in trainer.optimizers] or "no optimizer"
        raise TypeError(
            "fn.integrations.lightning.FnCallback needs an fn.optim optimizer (e.g. "
            f"fn.optim.OnebitAdam) or an fn.fsdp one (fn.fsdp.OnebitAdam) from "
            f"configure_optimizers, got {names}"
        )
    return found


def _check_sharded_run(trainer: Trainer, optimizer: ShardedOnebitOptimizer) -> None:
    """Raises, the same on every rank (every input is), where an ``fn.fsdp`` 1-bit optimizer
    cannot run as this trainer is set up."""
    if len(trainer.optimizers) > 1:
        raise NotImplementedError(
            f"fn.integrations.lightning: {optimizer.name} must be the run's only optimizer "
            f"(configure_optimizers returned {len(trainer.optimizers)}): it updates every "
            "trainable param of the FSDP2 model"
        )
    # The strategy has no public accessor for its checkpoint format.
    if not getattr(trainer.strategy, "_save_distributed_checkpoint", True):
        raise NotImplementedError(
            "fn.integrations.lightning: ModelParallelStrategy(save_distributed_checkpoint="
            f"False) with {optimizer.name}: its state holds every rank's own error feedback "
            "and its shards, which Lightning's single-file checkpoint (a torch optimizer's "
            "state gathered on rank 0) cannot hold; keep the default "
            "save_distributed_checkpoint=True"
        )


def _map_clipping(trainer: Trainer, optimizers: list[Any]) -> bool:
    """Hands the Trainer's ``gradient_clip_val`` to the optimizers as their ``max_grad_norm``,
    which clips the gradient that enters the momentum by one factor on every rank, in the
    warmup and in the compressed phase (where Lightning's clipping of ``.grad`` would come too
    late, or clip each rank's local gradient by its own factor): for an ``fn.fsdp`` 1-bit
    optimizer always (it then clips by norm or refuses), for ``fn.optim`` where every optimizer
    is an ``fn.optim.OnebitAdam`` or ``OnebitLamb`` and the Trainer clips by norm (otherwise
    Lightning clips ``.grad`` as usual). Lightning's own clipping then steps aside.

    The ranks check these settings in one all-gather over the world, so that ranks whose
    Trainers or optimizers differ raise together; a refusal leaves the optimizers unchanged.

    Returns:
        Whether the optimizers took ``gradient_clip_val``.

    Raises:
        NotImplementedError: on every rank, ``gradient_clip_algorithm="value"`` with an
            ``fn.fsdp`` 1-bit optimizer, which fn has no equivalent of.
        ValueError: on every rank, a ``gradient_clip_val`` that is not finite, or one that
            differs from the ``max_grad_norm`` an optimizer was built with; or the ranks'
            Trainers or optimizers differ in these settings.
    """
    clip, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
    clips = clip is not None and clip > 0  # Lightning clips nothing at 0 or below
    by_norm = algorithm in (None, GradClipAlgorithmType.NORM)
    sharded = [o for o in optimizers if isinstance(o, ShardedOnebitOptimizer)]
    every = len(optimizers) == len(trainer.optimizers)
    clipping = all(isinstance(o, (OnebitAdam, OnebitLamb)) for o in optimizers)
    takes = clips and (bool(sharded) or (by_norm and every and clipping))
    problem, names = None, [getattr(o, "name", type(o).__name__) for o in optimizers]
    if clips and sharded and not by_norm:
        problem = (
            NotImplementedError,
            f"gradient_clip_algorithm='value' with {names[0]}: fn clips the gradient's norm "
            "(max_grad_norm), not its values; use gradient_clip_algorithm='norm' (the default)",
        )
    elif takes and not math.isfinite(clip):
        problem = (ValueError, f"gradient_clip_val must be finite, got {clip!r}")
    elif takes and any(o.max_grad_norm not in (None, clip) for o in optimizers):
        other = next(o for o in optimizers if o.max_grad_norm not in (None, clip))
        problem = (
            ValueError,
            f"gradient_clip_val={clip!r} and {getattr(other, 'name', type(other).__name__)}("
            f"max_grad_norm={other.max_grad_norm!r}) differ: fn clips once, inside step(); set "
            "one of them, or both to the same value",
        )
    settings = {
        "gradient_clip_val": clip,
        "gradient_clip_algorithm": str(algorithm),
        "max_grad_norm": [getattr(o, "max_grad_norm", None) for o in optimizers],
    }
    comm = ProcessGroup() if dist.is_initialized() else Local()
    agree(comm, _NAME, settings, problem, device=trainer.strategy.root_device)
    if takes:
        for optimizer in optimizers:
            optimizer.max_grad_norm = float(clip)
    return takes


class _ShardedClipping:
    """The strategy's precision plugin's ``clip_gradients`` (which Lightning runs after the
    closure, before ``optimizer.step()`` updates, for ``gradient_clip_val`` or a module's
    ``configure_gradient_clipping``), replaced on that instance by :class:`FnCallback`. For an
    ``fn.fsdp`` 1-bit optimizer it clips nothing: the optimizer clips inside ``step()`` with its
    ``max_grad_norm`` (:func:`_map_clipping`), and clipping ``.grad`` as well would clip twice in
    the warmup and warn in a 1-D mesh's compressed phase, where ``step()`` does not read
    ``.grad``. Any other optimizer goes through the plugin's own method."""

    def __init__(self, plugin: Any) -> None:
        self.clip_gradients = plugin.clip_gradients

    @classmethod
    def install(cls, plugin: Any) -> None:
        """Routes ``plugin``'s clipping through this class (once)."""
        if isinstance(getattr(plugin.clip_gradients, "__self__", None), cls):
            return
        plugin.clip_gradients = cls(plugin).clip

    def clip(
        self,
        optimizer: Any,
        clip_val: float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Nothing for an ``fn.fsdp`` 1-bit optimizer that clips to ``clip_val`` itself; the
        plugin's clipping for any other optimizer.

        Raises:
            NotImplementedError: clipping by value of an ``fn.fsdp`` 1-bit optimizer.
            ValueError: clipping an ``fn.fsdp`` 1-bit optimizer to another norm than its
                ``max_grad_norm`` (``clip_gradients`` in ``configure_gradient_clipping``).
        """
        inner = getattr(optimizer, "optimizer", optimizer)  # inside a LightningOptimizer
        if not isinstance(inner, ShardedOnebitOptimizer):
            self.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
            return
        if clip_val is None or clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise NotImplementedError(
                f"{_NAME}: clipping by value with {inner.name}: fn clips the gradient's norm "
                "inside step() (max_grad_norm); clip with gradient_clip_algorithm='norm'"
            )
        if clip_val != inner.max_grad_norm:
            raise ValueError(
                f"{_NAME}: clipping to the norm {clip_val!r} with {inner.name}, whose "
                f"max_grad_norm is {inner.max_grad_norm!r}: it clips inside step(), to "
                "max_grad_norm, which the Trainer's gradient_clip_val sets at fit start; clip "
                "to that value, or build the optimizer with max_grad_norm="
            )


def _loaders(iterables: Any) -> Iterator[Any]:
    """The loaders of ``trainer.train_dataloader``: one, or a nest of mappings and sequences."""
    if isinstance(iterables, Mapping):
        iterables = list(iterables.values())
    if not isinstance(iterables, (list, tuple)):
        yield iterables
        return
    for item in iterables:
        yield from _loaders(item)


def _check_sampler(trainer: Trainer, optimizer: ShardedOnebitOptimizer) -> None:
    """Raises ``ValueError``, the same on every rank (every rank's loaders are built alike),
    where a training loader's ``DistributedSampler`` deals the data over another number of
    ranks than the world's: each rank of an ``fn.fsdp`` 1-bit optimizer computes its own
    gradient, so the ranks that drew the same slice would train on the same batches."""
    world = trainer.world_size
    for loader in _loaders(trainer.train_dataloader):
        batches = getattr(loader, "batch_sampler", None)
        for sampler in (getattr(loader, "sampler", None), getattr(batches, "sampler", None)):
            if isinstance(sampler, DistributedSampler) and sampler.num_replicas != world:
                raise ValueError(
                    "fn.integrations.lightning: the training loader's DistributedSampler deals "
                    f"the data over {sampler.num_replicas} replicas, not the {world} ranks: "
                    f"with {optimizer.name} every rank computes its own gradient, so the ranks "
                    "of a replica would train on the same batches (ModelParallelStrategy's "
                    "sampler deals over its data_parallel dimension). Use "
                    f"ModelParallelStrategy(data_parallel_size={world}, tensor_parallel_size=1) "
                    "(on HSDP, configure_model builds the mesh of shape (trainer.num_nodes, "
                    "trainer.num_devices)), or use_distributed_sampler=False with "
                    "DistributedSampler(dataset, num_replicas=trainer.world_size, "
                    "rank=trainer.global_rank)"
                )


class _ShardedCheckpoints:
    """``ModelParallelStrategy``'s checkpoints of an ``fn.fsdp`` 1-bit optimizer, installed on the
    strategy by :class:`FnCallback` (its ``optimizer_state`` and ``load_checkpoint``, replaced
    on that instance; any other optimizer still goes through the strategy's own methods).

    The strategy saves an optimizer as ``get_optimizer_state_dict`` sees it, torch.optim's
    ``{"state", "param_groups"}`` layout, which an ``fn.fsdp`` 1-bit optimizer does not have (its
    momentum is one packed vector per FSDP2 module, its error feedback is per rank): torch's
    API refuses it (``NotImplementedError``), to save and to load. Here saving hands the
    strategy the optimizer's own DCP state dict (``ShardedOnebitOptimizer.state_dict()``),
    which the strategy's ``dcp.save`` writes as it is, every rank its shards and errors, under
    ``optimizer_<i>``. Loading reads that state as the optimizer lays it out (its header first,
    then ``checkpoint_template``), so a checkpoint of another model, other settings or another
    optimizer is refused on every rank before the model changes; then the strategy loads the
    model and the rest without the optimizer, and its ``load_state_dict`` restores it.
    """

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.optimizer_state = strategy.optimizer_state
        self.load_checkpoint = strategy.load_checkpoint

    @classmethod
    def install(cls, strategy: Strategy) -> None:
        """Routes ``strategy``'s optimizer checkpoints through this class (once)."""
        if isinstance(getattr(strategy.load_checkpoint, "__self__", None), cls):
            return
        routes = cls(strategy)
        strategy.optimizer_state = routes.save_optimizer
        strategy.load_checkpoint = routes.load

    def save_optimizer(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state for the checkpoint: an ``fn.fsdp`` 1-bit optimizer's own."""
        inner = getattr(optimizer, "optimizer", optimizer)  # inside a LightningOptimizer
        if isinstance(inner, ShardedOnebitOptimizer):
            return inner.state_dict()
        return self.optimizer_state(optimizer)

    def load(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads a checkpoint: an ``fn.fsdp`` 1-bit optimizer's state itself, the rest through the
        strategy."""
        strategy = self.strategy
        optimizers = strategy.optimizers
        sharded = [
            (i, o) for i, o in enumerate(optimizers) if isinstance(o, ShardedOnebitOptimizer)
        ]
        if not sharded:
            return self.load_checkpoint(checkpoint_path, weights_only=weights_only)
        ((index, optimizer),) = sharded
        path = Path(strategy.broadcast(checkpoint_path))
        if not path.is_dir():
            raise ValueError(
                f"fn.integrations.lightning: {path} is not a distributed checkpoint (a "
                f"directory, what ModelParallelStrategy saves by default): {optimizer.name}'s "
                "state is saved per rank; nothing was loaded"
            )
        state = read_onebit_state(optimizer, path, f"optimizer_{index}")
        strategy.optimizers = [o for o in optimizers if o is not optimizer]
        try:
            metadata = self.load_checkpoint(checkpoint_path, weights_only=weights_only)
        finally:
            strategy.optimizers = optimizers
        optimizer.load_state_dict(state)
        return metadata


class FnCallback(Callback):
    """Connects the ``fn.optim`` optimizers, or the ``fn.fsdp`` 1-bit optimizer, of a Lightning
    run to its strategy: ``Trainer(callbacks=[FnCallback()])``.

    - At fit start (after the strategy wrapped the model in DDP, or after ``configure_model``
      sharded it, and built the optimizers; before the first backward pass and before a
      checkpoint is loaded): checks the strategy (:func:`check_strategy`) and warns when no
      update within the run's ``trainer.estimated_stepping_batches`` would be compressed.
      For ``fn.optim``: passes the DDP model (``trainer.strategy.model``, under
      ``strategy="ddp"`` and its variants) to ``fn.ddp.register`` (DDP then averages in warmup
      and is silent once compressed); ``gradient_clip_val`` (by norm, every optimizer an
      ``fn.optim.OnebitAdam`` or ``OnebitLamb``) becomes the optimizers' ``max_grad_norm``,
      which clips by one factor on every rank in both phases, and Lightning's own clipping is
      turned off for the fit (``trainer.gradient_clip_val`` is ``None`` until the fit ends),
      so that it is not applied twice. Otherwise Lightning clips ``.grad`` as usual, which
      the update reads: the averaged gradient in the warmup, each rank's local gradient with
      its own factor once compressed. ``accumulate_grad_batches`` needs nothing: Lightning
      runs the micro-batches but the last under DDP's ``no_sync()``, and the hook averages (or
      not) the accumulated gradient of the last. For an ``fn.fsdp`` 1-bit optimizer under
      ``ModelParallelStrategy``: refuses, on every rank, what it cannot run with (another
      optimizer beside it, ``save_distributed_checkpoint=False``; an FSDP2 mesh smaller than
      the world without ``replicate=`` is refused by the optimizer itself); hands the
      Trainer's ``gradient_clip_val`` to the optimizer as its ``max_grad_norm``, which clips
      the gradient entering the momentum in every phase, and makes Lightning's own clipping
      of ``.grad`` step aside for it (``gradient_clip_algorithm="value"``, or a
      ``gradient_clip_val`` other than the ``max_grad_norm`` the optimizer was built with, is
      refused on every rank); and routes the strategy's optimizer checkpoints through the
      optimizer's own DCP state dict (``_ShardedCheckpoints``).
      ``accumulate_grad_batches=k`` needs nothing: the strategy reduce-scatters every
      micro-batch's gradient (Lightning divides each loss by ``k``), the optimizer accumulates
      them (on HSDP in FSDP2's ``.grad`` shards; on a 1-D mesh, once compressed, each rank's
      whole local gradient, ``accumulate_dtype``) and makes the update's one exchange across
      the ranks or nodes in ``step()``. Lightning's checkpoints (``ModelCheckpoint`` by steps
      or epochs) come after an update; one between the micro-batches of an update
      (``train_time_interval``, say) is refused by the optimizer (``RuntimeError``).
    - At the start of training (``on_train_start``: the loaders are built, before the first
      batch), for an ``fn.fsdp`` 1-bit optimizer: refuses, on every rank, a training loader
      whose ``DistributedSampler`` deals the data over another number of ranks than the world
      (``ModelParallelStrategy``'s own sampler deals over its ``data_parallel`` dimension):
      every rank computes its own gradient and must train on its own batches.
    - On every checkpoint (``on_save_checkpoint``, which Lightning runs on every rank while it
      builds the checkpoint): for ``fn.optim``, gathers every rank's error feedback into rank
      0's optimizer state (``gather_error_feedback``, a collective) and puts that state into
      the checkpoint that rank 0 writes; an ``fn.fsdp`` 1-bit optimizer's state is written by every
      rank (DCP). Either way ``trainer.fit(model, ckpt_path=...)`` resumes every rank bit for
      bit.

    HSDP (README.md, "1-bit across nodes on HSDP"): every rank trains on its own batches, so
    every rank is a data-parallel rank to Lightning:
    ``ModelParallelStrategy(data_parallel_size=<world size>, tensor_parallel_size=1)``, whose
    distributed sampler then deals the batches over the world. Build the HSDP mesh of the
    ``N`` nodes of ``L`` ranks in ``configure_model`` (``init_device_mesh(
    self.device_mesh.device_type, (self.trainer.num_nodes, self.trainer.num_devices),
    mesh_dim_names=("replicate", "shard"))``), ``fully_shard`` every module on
    ``mesh["shard"]``, and return ``fn.fsdp.OnebitAdam(self, ..., replicate=mesh["replicate"])``
    from ``configure_optimizers``; checkpoints resume as on one mesh, and on another mesh shape
    resharded (the error feedback restarts with a warning). The strategy's default sizes
    (``data_parallel_size`` the nodes) would deal the batches by node, the ``L`` ranks of a node
    drawing the same: refused at the start of training, as above. Accumulation and clipping run
    as on one mesh; with accumulation HSDP holds no more than FSDP2's ``.grad`` shards, where a
    1-D mesh's compressed phase holds each rank's whole local gradient.

    Example:
        One process, no DDP (under ``torchrun`` with ``strategy="ddp"`` the same lines register
        the DDP model):

        >>> import lightning, torch
        >>> class Model(lightning.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = torch.nn.Linear(4, 1)
        ...     def training_step(self, batch, batch_idx):
        ...         return self.net(batch[0]).pow(2).mean()
        ...     def configure_optimizers(self):
        ...         return fn.optim.OnebitAdam(self.parameters(), lr=1e-2, freeze_step=2)
        >>> data = torch.utils.data.TensorDataset(torch.randn(8, 4))
        >>> trainer = lightning.Trainer(
        ...     accelerator="cpu", devices=1, max_steps=4, callbacks=[FnCallback()],
        ...     logger=False, enable_checkpointing=False, enable_progress_bar=False,
        ...     enable_model_summary=False)
        >>> trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=2))
        >>> trainer.global_step
        4
    """

    # Trainer.gradient_clip_val while the fit runs with it as the optimizers' max_grad_norm
    _lightning_clip: float | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Checks the strategy, connects the optimizers to it, and warns if no update within
        the run would be compressed."""
        del pl_module
        steps = trainer.estimated_stepping_batches
        found = _fn_optimizers(trainer)
        for _, optimizer in found:
            check_strategy(trainer.strategy, optimizer)
            if isinstance(optimizer, ShardedOnebitOptimizer):
                _check_sharded_run(trainer, optimizer)
                _ShardedCheckpoints.install(trainer.strategy)
                _ShardedClipping.install(trainer.strategy.precision_plugin)
            else:
                register_ddp(trainer.strategy.model, optimizer)
            if math.isfinite(steps):
                optimizer.warn_if_never_compressed(
                    int(steps), "the Trainer's estimated_stepping_batches"
                )
        optimizers = [o for _, o in found]
        mapped = _map_clipping(trainer, optimizers)
        if mapped and not any(isinstance(o, ShardedOnebitOptimizer) for o in optimizers):
            self._lightning_clip = trainer.gradient_clip_val
            trainer.gradient_clip_val = None

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Gives the trainer back its ``gradient_clip_val``."""
        del pl_module
        self._restore_clip(trainer)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        """Gives the trainer back its ``gradient_clip_val``."""
        del pl_module, exception
        self._restore_clip(trainer)

    def _restore_clip(self, trainer: Trainer) -> None:
        if self._lightning_clip is not None:
            trainer.gradient_clip_val, self._lightning_clip = self._lightning_clip, None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Refuses a training loader that would deal the same batches to several ranks of an
        ``fn.fsdp`` 1-bit optimizer."""
        del pl_module
        for _, optimizer in _fn_optimizers(trainer):
            if isinstance(optimizer, ShardedOnebitOptimizer):
                _check_sampler(trainer, optimizer)

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Gathers every rank's error feedback of an ``fn.optim`` optimizer and saves rank 0's
        optimizer state with it."""
        del pl_module
        for index, optimizer in _fn_optimizers(trainer):
            if isinstance(optimizer, ShardedOnebitOptimizer):
                continue  # the strategy saved its own state (_ShardedCheckpoints)
            optimizer.gather_error_feedback()
            # Lightning takes the optimizer states before it calls this hook: take them again.
            states = checkpoint.get("optimizer_states")
            if states is not None:
                states[index] = trainer.strategy.optimizer_state(trainer.optimizers[index])
