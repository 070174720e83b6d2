"""PerCache for LangChain: an LLM cache, a recording retriever, and an LLM and a chat model
on a PerCache's llama.cpp engine that reuse chunk states without changing the text.

>>> from langchain_core.globals import set_llm_cache                       # doctest: +SKIP
>>> set_llm_cache(PerCacheLLMCache(pc))                                     # doctest: +SKIP
>>> chain = PerCacheRetriever(inner=retriever, percache=pc) | prompt | PerCacheLLM(percache=pc)  # doctest: +SKIP

Importing this package imports langchain-core but loads no model. The names of 0.2
(``PerCacheLlamaCPP``, ``PerCacheChatLlamaCPP``, ``PerCacheSemanticCache``) still import,
with a ``DeprecationWarning``.
"""

import warnings
from typing import Any

from ._imports import require_langchain

require_langchain()

from .cache import PerCacheLLMCache  # noqa: E402
from .chat_model import PerCacheChatModel  # noqa: E402
from .llm import PerCacheLLM  # noqa: E402
from .retriever import PerCacheRetriever  # noqa: E402

__all__ = ["PerCacheChatModel", "PerCacheLLM", "PerCacheLLMCache", "PerCacheRetriever"]

_RENAMED = {  # the 0.2 name -> the class
    "PerCacheLlamaCPP": PerCacheLLM,  # LlamaIndex's PerCacheLlamaCPP is another class
    "PerCacheChatLlamaCPP": PerCacheChatModel,
    "PerCacheSemanticCache": PerCacheLLMCache,  # exact by default: not semantic unless asked
}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(f"{name} is now {new.__name__}", DeprecationWarning, stacklevel=2)
        return new
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
