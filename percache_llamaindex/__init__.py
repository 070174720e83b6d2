"""PerCache for LlamaIndex: swap ``index.as_query_engine()`` for ``PerCacheQueryEngine``.

>>> from percache_llamaindex import PerCacheQueryEngine   # doctest: +SKIP
>>> engine = PerCacheQueryEngine.from_index(index, cache_dir="~/.percache/notes", similarity_top_k=3)  # doctest: +SKIP
>>> engine.query("When is the rehearsal?").metadata["percache"].get("source")   # doctest: +SKIP
'full'

Importing this package imports LlamaIndex but loads no model.
"""

from ._imports import require_llama_index

require_llama_index()

from .embedding import PerCacheEmbedding  # noqa: E402
from .llm import PerCacheLlamaCPP  # noqa: E402
from .postprocessor import PerCacheNodePostprocessor  # noqa: E402
from .query_engine import PerCacheQueryEngine  # noqa: E402

__all__ = ["PerCacheEmbedding", "PerCacheLlamaCPP", "PerCacheNodePostprocessor", "PerCacheQueryEngine"]
