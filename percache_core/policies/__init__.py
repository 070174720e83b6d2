"""Reuse policies, chosen once when a cache opens or is configured.

- :mod:`~percache_core.policies.answers`: how a stored answer may be served: as drafts the
  model verifies (``ExactAnswers``) or, within the bound, without the model
  (``SemanticAnswers``);
- :mod:`~percache_core.policies.states`: how chunk states may be reused: stored prefixes
  only (``StoredPrefixes``) or, within the bound, composed from independent states
  (``ComposedStates``).

:func:`policies_for` picks both from a configuration. The request path, the caller verbs
and idle work ask these objects; no other module compares a mode string.
"""

from .answers import AnswerLookup, AnswerPolicy, ExactAnswers, SemanticAnswers, answer_policy
from .states import ComposedStates, StatePolicy, StoredPrefixes, recompute_ladder, state_policy

__all__ = [
    "AnswerLookup",
    "AnswerPolicy",
    "ComposedStates",
    "ExactAnswers",
    "SemanticAnswers",
    "StatePolicy",
    "StoredPrefixes",
    "answer_policy",
    "recompute_ladder",
    "state_policy",
]
