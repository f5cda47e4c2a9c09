"""torchft glue: fn.diloco's outer step under torchft's ``Manager`` (the ``torchft`` extra,
``pip install "fn-optim[torchft]"``), so that workers leave and join without stopping the job.

- :class:`ElasticDiLoCo`: DiLoCo's outer step every ``sync_every`` inner steps, over the
  current quorum's participants and applied only when the Manager's commit vote passes; a
  (re)joining worker recovers the anchor, the outer state and the counters from a live peer;
- :class:`ManagerComm`: fn's ``Comm`` over the Manager's process group, whose failures are
  reported to the Manager instead of raised.

The caller builds the ``Manager`` and its process group. Without torchft, importing this
package raises ``ModuleNotFoundError`` naming the extra (``import fn`` never imports it). The
guide is docs/guides/diloco.md, "Elastic DiLoCo with torchft".
"""

try:
    import torchft  # noqa: F401
except ModuleNotFoundError as err:
    if err.name != "torchft":
        raise
    raise ModuleNotFoundError(
        'fn.integrations.torchft needs torchft 0.2.0, the "torchft" extra: '
        'pip install "fn-optim[torchft]"',
        name="torchft",
    ) from err

from fn.integrations.torchft.comm import ManagerComm
from fn.integrations.torchft.diloco import POSITIONAL_COMPRESSIONS, ElasticDiLoCo

__all__ = ["ElasticDiLoCo", "ManagerComm", "POSITIONAL_COMPRESSIONS"]
