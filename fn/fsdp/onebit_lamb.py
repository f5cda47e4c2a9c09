"""``OnebitLamb``: 1-bit LAMB on a model sharded by FSDP2, its 1-bit allreduce of the scaled
momenta inside the reduce-scatter of every FSDP2 module (the machinery of
:class:`~fn.fsdp.onebit.ShardedOnebitOptimizer`; the rule in docs/algorithms.md, "1-bit Adam
and 1-bit LAMB on FSDP2")."""

from __future__ import annotations

from torch import Tensor

from fn.fsdp.onebit import OPTIONS, Input, ShardedOnebitOptimizer
from fn.fsdp.onebit_module import OnebitModule
from fn.transforms import onebit_lamb, onebit_lamb_sharded
from fn.transforms.hyperparameters import signature_with

__all__ = ["OnebitLamb"]


class OnebitLamb(ShardedOnebitOptimizer):
    r"""1-bit LAMB (``fn.onebit_lamb``) over a model sharded by FSDP2 (``fully_shard``).

    As :class:`~fn.fsdp.OnebitAdam` (the same reduce-scatter, checks, checkpoints and policies),
    with 1-bit LAMB's rule on the shards (``fn.transforms.onebit_lamb_sharded``, the per-leaf
    code of ``fn.onebit_lamb``). Its per-param trust ratios need full-tensor norms: each
    update all-gathers every rank's per-param sums of squares (and the factor's maxima), a few
    fp64 values per param, and reduces them in rank order, so every rank computes the same
    ratios. At the last warmup update the same all-gather carries the momentum norms that fix
    the scaling coefficients :math:`s_\ell`; from the freeze on, a module's compressed vector
    is its params' scaled momenta :math:`s_\ell(\beta_1 m_\ell + (1-\beta_1) g_{r,\ell})` in
    FSDP2's layout, the packed signs hold the scaled result, and ``step()`` reads
    :math:`m_\ell` back as its shard divided by :math:`s_\ell`:

    .. math::
        \hat g = (m - \beta_1 m_{last}) / (1 - \beta_1),\quad
        \tilde v \leftarrow \beta_2 \tilde v + (1-\beta_2) \hat g^2,\quad
        p \leftarrow p - \eta R f\, (\mathrm{clip}(m / (\sqrt v + \epsilon)) + \lambda p)

    with the frozen trust ratio :math:`R` and the factor :math:`f` of ``fn.onebit_lamb``.
    Per rank it keeps, beyond :class:`~fn.fsdp.OnebitAdam`'s buffers, the fresh variance
    :math:`\tilde v` and the momentum's fp32 shard (its value before the update), both
    ``n / W``, and three scalars per param.

    The one difference from ``fn.onebit_lamb`` with DDP is where the momenta are fused: per
    FSDP2 module (one error pair per module) instead of all params in one vector; a norm is
    the square root of the fp64 sum of the shards' sums of squares, rounded once to fp32
    (``fn.onebit_lamb`` takes ``torch.linalg.vector_norm`` of the full tensor).

    Args:
        model: as :class:`~fn.fsdp.OnebitAdam`.
        lr: as ``fn.onebit_lamb``'s, read from ``param_groups[0]["lr"]`` at every step.
        freeze_step, betas, eps, weight_decay, safeguard: as ``fn.onebit_lamb``'s.
        max_coeff, min_coeff, coeff_beta: as ``fn.onebit_lamb``'s.
        factor_max, factor_min, factor_threshold: as ``fn.onebit_lamb``'s.
        exp_avg_mask: as :class:`~fn.fsdp.OnebitAdam`'s (``"auto"`` too).
        nonfinite, local_world_size, error_dtype: as :class:`~fn.fsdp.OnebitAdam`'s (the same
            options are not built yet).
        replicate, world: as :class:`~fn.fsdp.OnebitAdam`'s. On HSDP the compressed vector is this
            rank's row of the scaled momenta, and the norms are reduced over the shard group
            only (the ``N`` peers of a shard hold the same values).

    Raises:
        ValueError, NotImplementedError: as :class:`~fn.fsdp.OnebitAdam`, on every rank.

    Example:
        A run saved and loaded through :class:`~fn.fsdp.TrainingCheckpoint`:

        >>> import tempfile, torch, torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> import fn.fsdp
        >>> path = tempfile.mkdtemp()
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = fully_shard(torch.nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1,)))
        >>> opt = fn.fsdp.OnebitLamb(model, lr=1e-2, freeze_step=2)
        >>> checkpoint = fn.fsdp.TrainingCheckpoint(model, opt)
        >>> for _ in range(3):
        ...     opt.zero_grad()
        ...     model(torch.ones(1, 2)).square().sum().backward()
        ...     opt.step()
        ...     checkpoint.step += 1
        >>> checkpoint.save(path)
        >>> checkpoint.load(path)
        >>> opt.count, checkpoint.step
        (3, 3)
        >>> dist.destroy_process_group()
    """

    sharded_rule = staticmethod(onebit_lamb_sharded)
    replicated_rule = staticmethod(onebit_lamb)
    norms_over_shards = True  # the trust ratios' norms
    keeps_momentum_shards = True
    scalar_fields = ("lamb_coeff_freeze", "last_factor", "scaling_coeff")
    optional_fields = ("exp_avg_sq_fresh",)
    adam_start = (  # load_adam_state refuses
        "1-bit LAMB's frozen trust ratios (lamb_coeff_freeze) average the ratios of its own "
        "warmup updates, which Adam never computed; start 1-bit LAMB from its own warmup, or "
        "switch to fn.fsdp.OnebitAdam"
    )

    __signature__ = signature_with(onebit_lamb, "model", *OPTIONS, leave_out=("comm",))

    def _momentum_input(self, module: OnebitModule, momentum: Tensor, grad: Tensor) -> Input:
        """Every param's scaled momentum ``s (b1 m + (1 - b1) g_r)``, with ``m`` the packed
        result divided by ``s`` (at the freeze: the warmup's momentum, unscaled)."""
        layout = module.layout
        rows = momentum.view(-1, layout.padded_row)  # X's rows (on HSDP: this rank's row)
        grads = grad.view(-1, layout.padded_row)
        b1 = self._b1
        for slot in layout.slots:
            columns = slice(slot.offset, slot.offset + slot.width)
            s = self._state.scaling_coeff[slot.name]
            m = rows[:, columns] / s if module.signed else rows[:, columns]
            # rounded as fn.transforms' moving average: the two products, then their sum
            rows[:, columns] = (b1 * m + (1 - b1) * grads[:, columns]) * s
        return momentum, None, 0.0
