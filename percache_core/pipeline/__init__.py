"""``PerCache``: the facade that opens a cache folder, wires its parts and delegates.

Its verbs come in parts: opening and answering here, the knowledge's in
:mod:`~percache_core.pipeline.documents`, idle work's in :mod:`~percache_core.pipeline.idle`;
the parts are wired in :mod:`~percache_core.pipeline.wiring`.

The parts (:class:`~percache_core.answering.parts.CacheParts`): the knowledge bank, the QA bank, the
model runtime (engine, chunk states, prompt runner; loaded on first use), user activity
and usage counters. The request path (:mod:`percache_core.answering.request_path`) answers
questions over them; the scheduler (:mod:`percache_core.prediction.scheduler`) does idle work over
them, run by the idle worker. None of these sees this class.
"""

from ..serving.streaming import AnswerStream
from .facade import PerCache

__all__ = ["AnswerStream", "PerCache"]
