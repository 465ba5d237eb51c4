"""`--ci-test`'s end-of-run metric check: the gate a CI recipe puts on a run (reference CLI, "CI" table).

The run passes when any value of `--ci-metric-checker-key` logged during the run (one per metrics record that
holds the key) is >= `--ci-metric-checker-threshold`: an eval reward that reaches the bar once, at any eval,
passes. It fails when no record holds the key or every value stays below; train_diffusion.py then exits with
status 2 and one line naming the key, the threshold and the values seen.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from miles.config.sections import LoggingConfig
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)


def check_ci_metric(config: LoggingConfig, history: Sequence[dict[str, Any]]) -> None:
    """Raise MilesUserError unless some record's value of the checker key reaches the threshold (validation makes
    --ci-test and both checker flags go together)."""
    if not config.ci_test:
        return
    key, threshold = config.ci_metric_checker_key, config.ci_metric_checker_threshold
    values = [float(record[key]) for record in history if key in record]
    if not values:
        raise MilesUserError(f"--ci-test: no metrics record holds --ci-metric-checker-key {key!r} (check the name, "
                             "and that the run logs it, e.g. an eval set for eval/<name>/*)")
    best = max(values)
    if best < threshold:
        shown = ", ".join(f"{value:.4g}" for value in values[-5:])
        raise MilesUserError(f"--ci-test: {key} never reached --ci-metric-checker-threshold {threshold:g} (best "
                             f"{best:.4g} over {len(values)} record(s); last: {shown})")
    logger.info("--ci-test: %s reached %.4g >= %g", key, best, threshold)
