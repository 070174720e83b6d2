"""PerCache for LangChain: an LLM cache, a recording retriever, and a llama.cpp LLM and chat
model that reuse chunk states without changing the text.

>>> from langchain_core.globals import set_llm_cache                       # doctest: +SKIP
>>> set_llm_cache(PerCacheSemanticCache(pc))                                # doctest: +SKIP
>>> chain = PerCacheRetriever(inner=retriever, percache=pc) | prompt | PerCacheLlamaCPP(percache=pc)  # doctest: +SKIP

Importing this package imports langchain-core but loads no model.
"""

from ._imports import require_langchain

require_langchain()

from .cache import PerCacheSemanticCache  # noqa: E402
from .chat_model import PerCacheChatLlamaCPP  # noqa: E402
from .llm import PerCacheLlamaCPP  # noqa: E402
from .retriever import PerCacheRetriever  # noqa: E402

__all__ = ["PerCacheChatLlamaCPP", "PerCacheLlamaCPP", "PerCacheRetriever", "PerCacheSemanticCache"]
