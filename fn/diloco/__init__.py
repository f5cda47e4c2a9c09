"""DiLoCo: workers take local steps and meet for an outer step, with a compressed, error-fed
exchange.

Every worker (a rank of ``comm``, or one per shard position of a sharded worker) runs its own
inner optimizer for ``H`` steps; then :func:`outer_step` averages the pseudo-gradients ``anchor
- params`` through an outer compressor and moves the shared anchor with an outer rule:

- :func:`nesterov`: DiLoCo's Nesterov SGD (lr 0.7, momentum 0.9) after any compressor;
- :func:`sparseloco`: SparseLoCo's error-feedback accumulator in place of momentum, sent as
  chunk-wise top-k in 2 bits;
- :func:`compression`: the compressors by name (:data:`COMPRESSIONS`): dense fp32 and bf16,
  int8 without error feedback, 4-bit LoCo and 1-bit with error feedback, and top-k.

The rules are transforms over the pseudo-gradient pytree with their state explicit; the
compressors are ``fn.collectives`` transforms that thread their error feedback. They run on
``Local``, ``Simulated`` and ``ProcessGroup``. :class:`DiLoCo` hooks the outer step onto any
inner optimizer's ``step()`` and keeps the anchor, the outer state and the counters for
checkpoints (``torch.save`` per rank, or ``torch.distributed.checkpoint``), for workers of one
rank or sharded by FSDP2; with Streaming DiLoCo's ``fragments`` it syncs one fragment at a
time, and with its ``delay`` it overlaps each fragment's exchange with the next inner steps on a
background thread. A worker whose step holds NaN or Inf sits an outer step out while the
others commit (participation: ``outer_update``'s ``takes_part``, ``fn.collectives.Participation``
in the compressors). docs/algorithms.md, "DiLoCo: local steps and a compressed outer step"
specifies them.
"""

from fn.diloco.compressors import COMPRESSIONS, compression
from fn.diloco.nesterov_rule import nesterov
from fn.diloco.rules import OUTER_RULES
from fn.diloco.sparseloco_rule import sparseloco
from fn.diloco.step import OuterStep, outer_step, outer_update, pseudo_gradient, trainable_params
from fn.diloco.wrapper import DiLoCo

__all__ = [
    "COMPRESSIONS",
    "compression",
    "nesterov",
    "sparseloco",
    "OuterStep",
    "outer_step",
    "outer_update",
    "pseudo_gradient",
    "trainable_params",
    "OUTER_RULES",
    "DiLoCo",
]
