"""The dense optimizer: AdamW with linear warmup and cosine decay, after global-norm clipping."""

from __future__ import annotations

import optax

from gem_jax.config import TrainConfig


def learning_rate_schedule(config: TrainConfig, steps: int) -> optax.Schedule:
    """Warmup to `learning_rate`, then cosine decay to `end_learning_rate_fraction` of it at `steps`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=max(config.warmup_steps, 1),
        decay_steps=max(steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.end_learning_rate_fraction,
    )


def make_optimizer(config: TrainConfig, steps: int) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(
            learning_rate_schedule(config, steps), b2=config.adam_b2, weight_decay=config.weight_decay
        ),
    )
