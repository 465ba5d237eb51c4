"""The generic default `--rollout-function-path` (`miles.rollout.sglang_rollout.generate_rollout`).

For diffusion runs it is the diffusion rollout itself; see `miles.rollout.sglang_diffusion_rollout`.
"""

from miles.rollout.sglang_diffusion_rollout import generate_rollout, generate_rollout_async

__all__ = ["generate_rollout", "generate_rollout_async"]
