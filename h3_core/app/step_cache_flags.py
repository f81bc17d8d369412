"""The CLI's step-cache flags, which the local run reads (cli.py) and a --server run refuses (remote_cli.py)."""

from __future__ import annotations

from ..step_cache_settings import STEP_CACHE_OFF

# The step cache's expert numbers: flag, argparse name, the settings field (or fields) it sets.
STEP_CACHE_NUMBER_FLAGS = (("--step-cache-blocks", "step_cache_blocks", ("first_blocks", "last_blocks")),
                           ("--step-cache-threshold", "step_cache_threshold", ("threshold",)),
                           ("--step-cache-warmup", "step_cache_warmup", ("warmup_steps",)),
                           ("--step-cache-max-consecutive", "step_cache_max_consecutive", ("max_consecutive",)))


def step_cache_flags_given(args) -> list[str]:
    """The step-cache flags the command line sets (--step-cache when not off, then the expert numbers)."""
    given = ["--step-cache"] if args.step_cache != STEP_CACHE_OFF else []
    return given + [flag for flag, name, _ in STEP_CACHE_NUMBER_FLAGS if getattr(args, name) is not None]
