"""The diffusion math both the rollout engine and the trainer run (docs/algorithms.md §1–§9).

Submodules: `schedules` (sigma grids), `sde` (step kinds with log-probs), `advantages` (GRPO), `losses`
(policy / nft / sft / custom), `ema`, `lr_scheduler`. Import from the submodules; the names below are
re-exported for convenience.
"""

from miles.diffusion.advantages import compute_grpo_advantages
from miles.diffusion.schedules import dynamic_shift_mu, flow_match_sigmas, sft_sigma_grid, shift_sigmas
from miles.diffusion.sde import (
    CpsSdeStepBackend,
    DiffusersSdeStepBackend,
    SdeStepBackend,
    StepOutput,
    build_sde_backend,
    ode_step,
    use_no_const_log_prob,
)

__all__ = [
    "compute_grpo_advantages",
    "dynamic_shift_mu",
    "flow_match_sigmas",
    "sft_sigma_grid",
    "shift_sigmas",
    "CpsSdeStepBackend",
    "DiffusersSdeStepBackend",
    "SdeStepBackend",
    "StepOutput",
    "build_sde_backend",
    "ode_step",
    "use_no_const_log_prob",
]
