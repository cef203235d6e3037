"""The checks of a run config's differential privacy keys (`RunConfig.privacy_checks`, florist/config.py):
`dp` and its keys, user-level (docs/privacy.md) and record-level (DP-SGD on every node, "Record-level dp")."""

from __future__ import annotations

import math
from typing import Any

from florist.common import privacy


def checks(cfg: Any) -> list[tuple[bool, str]]:
    """`dp` and its keys: a budget (ε or σ) when on, nothing of it when off, and no rule that
    needs each node's update (those change the sensitivity the noise is sized for); record-level
    dp alone (DP-SGD on every node) changes no update's sensitivity, so it takes any rule."""
    on = cfg.dp != "none"
    user = cfg.user_dp if cfg.dp in privacy.MODES else "none"
    return [
        (cfg.dp in privacy.MODES, f"dp must be one of {', '.join(privacy.MODES)}, got {cfg.dp!r}"),
        (cfg.dp_clip > 0 and math.isfinite(cfg.dp_clip), "dp-clip must be a finite number > 0"),
        (cfg.dp_epsilon > 0, "dp-epsilon must be > 0 (inf: none)"),
        (0 < cfg.dp_delta < 1, "dp-delta must be in (0, 1)"),
        (
            cfg.dp_noise_multiplier >= 0 and math.isfinite(cfg.dp_noise_multiplier),
            "dp-noise-multiplier must be a finite number >= 0 (0: calibrated from dp-epsilon)",
        ),
        (
            cfg.dp_relation in privacy.LOCAL_RELATIONS and (user == "local" or cfg.dp_relation == "zero-out"),
            f'dp-relation must be one of {", ".join(privacy.LOCAL_RELATIONS)}, replace-one under dp = "local" '
            f"only (central's is add/remove, distributed's zero-out): got {cfg.dp_relation!r} (dp {cfg.dp!r})",
        ),
        (cfg.dp_noise_seed >= 0, "dp-noise-seed must be >= 0 (0: noise from the OS's entropy)"),
        (
            not on or math.isfinite(cfg.dp_epsilon) or cfg.dp_noise_multiplier > 0,
            f'dp = "{cfg.dp}" needs dp-epsilon (the budget) or dp-noise-multiplier (σ, ε reported)',
        ),
        (
            on or (cfg.dp_noise_multiplier == 0 and cfg.dp_clip == 1.0 and cfg.dp_noise_seed == 0),
            'dp-clip, dp-noise-multiplier and dp-noise-seed act only with dp other than "none"',
        ),
        *record_checks(cfg, combined=cfg.record_dp and user != "none"),
        (
            user == "none" or cfg.aggregation == "mean",
            f'dp = "{cfg.dp}" needs aggregation = "mean": {cfg.aggregation} needs each node\'s update, '
            "and its sensitivity is not the one the noise is sized for",
        ),
        (
            user == "none" or cfg.clip_norm == 0,
            "clip-norm and dp clip both: dp-clip alone bounds each update under dp",
        ),
        (
            user != "distributed" or cfg.secure_aggregation != "none",
            'dp = "distributed" needs secure-aggregation = "secaggplus": its nodes\' noise shares add up to '
            'central\'s only in a masked sum (in the clear, use dp = "central")',
        ),
    ]


def record_checks(cfg: Any, combined: bool) -> list[tuple[bool, str]]:
    """Record-level dp's: the dp-user-* keys only under `record+…` (`combined`) and a budget for them there,
    and a model whose per-sample gradients exist."""
    return [
        (cfg.dp_user_clip > 0 and math.isfinite(cfg.dp_user_clip), "dp-user-clip must be a finite number > 0"),
        (cfg.dp_user_epsilon > 0, "dp-user-epsilon must be > 0 (inf: none)"),
        (
            cfg.dp_user_noise_multiplier >= 0 and math.isfinite(cfg.dp_user_noise_multiplier),
            "dp-user-noise-multiplier must be a finite number >= 0 (0: calibrated from dp-user-epsilon)",
        ),
        (
            combined
            or (math.isinf(cfg.dp_user_epsilon) and cfg.dp_user_clip == 1.0 and cfg.dp_user_noise_multiplier == 0),
            'dp-user-epsilon, dp-user-clip and dp-user-noise-multiplier act only under dp = "record+central", '
            '"record+local" or "record+distributed" (the user-level mechanism on top of DP-SGD)',
        ),
        (
            not combined or math.isfinite(cfg.dp_user_epsilon) or cfg.dp_user_noise_multiplier > 0,
            f'dp = "{cfg.dp}" needs dp-user-epsilon (the user-level budget) or dp-user-noise-multiplier too',
        ),
        (
            not cfg.record_dp or cfg.model != "mobilenet_v2",
            f'dp = "{cfg.dp}" needs per-sample gradients, and mobilenet_v2\'s BatchNorm mixes the samples of a '
            "batch: use model cnn, cnn-wide, lenet or mlp",
        ),
    ]
