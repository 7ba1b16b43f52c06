"""What a role's update answers the driver: the step's global metrics and its non-finite skips, typed (no hidden
metric keys). Identical on every rank of the role (the workers reduce before answering)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class UpdateResult:
    metrics: dict[str, float]  # verl-named: <role>/grad_norm, <role>/lr, actor/pg_loss, critic/vf_loss, ...
    optimizer_steps: int  # mini-batches x epochs attempted
    nonfinite_skips: int  # of those, skipped for a non-finite loss or gradient norm (weights untouched)
    nonfinite_losses: list[float] = field(default_factory=list)  # the skipped mini-batches' global losses
    nonfinite_grad_norms: list[float] = field(default_factory=list)

    def nonfinite_detail(self) -> str:
        return (f"{self.nonfinite_skips} of {self.optimizer_steps} updates skipped; their loss "
                f"{self.nonfinite_losses}, grad_norm {self.nonfinite_grad_norms}")
