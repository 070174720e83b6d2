"""How chunk states may be reused: :class:`StoredPrefixes` (exact, the default) or
:class:`ComposedStates` (``reuse="approximate"``: later chunks taken from their
independent states within the bound). :func:`state_policy` picks one from a configuration.

>>> from percache_core.config import PerCacheConfig
>>> state_policy(PerCacheConfig()).approximate
False
>>> state_policy(PerCacheConfig(reuse="approximate")).name
'approximate'
"""

from __future__ import annotations

from ..config import BoundSettings, PerCacheConfig, StateReuse, TierSettings
from ..qa.calibration import Calibration

RECOMPUTE_STEPS = (16, 32, 64, 128)


class StatePolicy:
    """Stored prefixes only: a prompt restores the longest stored exact prefix and
    prefills the rest, so its output is the cache-off output."""

    name: StateReuse = "exact"
    approximate = False  # whether a run under this policy may differ from the cache-off run

    def __init__(self, tiers: TierSettings, bound: BoundSettings) -> None:
        self.tiers = tiers
        self.bound = bound

    def recompute_tokens(self, calibration: Calibration) -> int | None:
        """The tokens of each composed chunk to prefill live, or None: compose nothing
        (the run is exact).

        Args:
            calibration: the labels composed runs were checked against.

        Returns:
            None under this policy.
        """
        return None

    def estimated_accuracy(self, calibration: Calibration, recompute: int | None) -> float | None:
        """The estimated probability that an answer composed with *recompute* tokens is
        right (None: exact, or no bound)."""
        return None

    @property
    def calibrates(self) -> bool:
        """Whether idle work should buy labels for composed runs."""
        return False


StoredPrefixes = StatePolicy


class ComposedStates(StatePolicy):
    """Where the stored exact prefix ends, later chunks come from their independent
    [system, chunk] states moved to their positions, with the first recompute tokens of
    each prefilled live. Under ``max_error_rate`` the recompute setting is the fewest
    tokens of :func:`recompute_ladder` whose labels meet the bound (None, nothing
    composed, until they do); with no bound the configured ``recompute_tokens``."""

    name: StateReuse = "approximate"
    approximate = True

    def recompute_tokens(self, calibration: Calibration) -> int | None:
        if not self.bound.bounded:
            return self.tiers.recompute_tokens
        return calibration.recompute_choice(recompute_ladder(self.tiers), self.bound.max_error_rate)

    def estimated_accuracy(self, calibration: Calibration, recompute: int | None) -> float | None:
        if recompute is None or not self.bound.bounded:
            return None
        return calibration.composed_accuracy(recompute)

    @property
    def calibrates(self) -> bool:
        return self.tiers.chunk_states and self.bound.bounded


def recompute_ladder(tiers: TierSettings) -> tuple[int, ...]:
    """The recompute settings composed chunk states are calibrated at: the configured
    ``recompute_tokens`` and the larger of 16, 32, 64 and 128 tokens.

    >>> recompute_ladder(TierSettings(recompute_tokens=16))
    (16, 32, 64, 128)
    """
    base = tiers.recompute_tokens
    return tuple(sorted({base, *(t for t in RECOMPUTE_STEPS if t > base)}))


def state_policy(config: PerCacheConfig) -> StatePolicy:
    """The chunk-state policy *config* names (``reuse``)."""
    kind = ComposedStates if config.tiers.reuse == "approximate" else StoredPrefixes
    return kind(config.tiers, config.bound)
