"""fn.integrations.lightning under DDP with fn.optim: ``accumulate_grad_batches=4`` and
``gradient_clip_val=1.0`` on 2 gloo ranks (tests/integrations/_lightning_ddp_accumulation.py,
one ``torchrun``): the run equals a plain DDP loop with ``OnebitAdam(max_grad_norm=1.0)`` bit
for bit (Lightning's own clipping off during the fit, the trainer's value back after it), the
ranks agree, and runs resumed from a warmup and a compressed checkpoint end bit-identical."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is in the 'lightning' extra")

from tests._distributed import ROOT, torchrun  # noqa: E402
from tests.integrations._lightning_ddp_accumulation import (  # noqa: E402
    CLIP,
    RESUME,
    STEPS,
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning_ddp_accumulation")
    torchrun(ROOT / "tests" / "integrations" / "_lightning_ddp_accumulation.py", str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_accumulation_and_clipping_equal_the_plain_loop_and_the_ranks_agree(ranks):
    for result in ranks:
        full = result["full"]
        assert full["steps"] == STEPS
        assert full["during"] == (CLIP, None)  # the optimizer clips, Lightning does not
        assert full["after"] == (CLIP, CLIP)  # the trainer's value is back
        assert torch.equal(full["params"], result["bare"])
        assert not torch.equal(full["params"], result["unclipped"])  # the clipping acted
    assert torch.equal(ranks[0]["full"]["params"], ranks[1]["full"]["params"])


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_resumed_runs_end_bit_identical(ranks):
    for result in ranks:
        for step in RESUME:
            resumed = result["resumed"][step]
            assert resumed["steps"] == STEPS
            assert torch.equal(resumed["params"], result["full"]["params"]), step
