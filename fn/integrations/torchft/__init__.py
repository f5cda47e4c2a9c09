"""torchft glue: fn.diloco's outer step under torchft's ``Manager`` (the ``torchft`` extra,
``pip install "fn-optim[torchft]"``), so that workers leave and join without stopping the job.

- :class:`ElasticDiLoCo`: DiLoCo's outer step every ``sync_every`` inner steps, over the
  current quorum's participants and applied only when the Manager's commit vote passes; a
  (re)joining worker recovers the anchor, the outer state and the counters from a live peer;
- :class:`ManagerComm`: fn's ``Comm`` over the Manager's process group, whose failures are
  reported to the Manager instead of raised.

This package imports nothing of torchft: the caller builds the ``Manager`` and its process
group. The guide is docs/guides/diloco.md, "Elastic DiLoCo with torchft".
"""

from fn.integrations.torchft.comm import ManagerComm
from fn.integrations.torchft.diloco import POSITIONAL_COMPRESSIONS, ElasticDiLoCo

__all__ = ["ElasticDiLoCo", "ManagerComm", "POSITIONAL_COMPRESSIONS"]
