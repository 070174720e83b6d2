"""``PerCacheQueryEngine``: ``index.as_query_engine()`` with PerCache in front.

The app's own engine does the work: ``index.as_query_engine(llm=llm, **kwargs)`` is built
with the user's arguments (prompt templates, ``response_mode``, node postprocessors,
streaming), and every question is retrieved by it. PerCache adds two things that cannot
change the answer:

- a stored answer is returned without calling the LLM only when it is bound to the same
  LLM (class and settings), the same response synthesizer (class, response mode, prompt
  templates) and the same retrieved nodes (ids, order, and the texts the LLM sees), and,
  in the default exact mode, the same question text; so an ``index.insert`` or
  ``delete_ref_doc`` that changes what is retrieved changes the binding. Semantic mode
  (``qa_mode="semantic"``, opt-in and approximate) serves similar questions too.
- with :class:`PerCacheLlamaCPP` as the LLM, each of the synthesizer's LLM calls restores
  the stored KV state of its prompt's longest known leading part (see its module).

Nothing is stored when retrieval finds no node (LlamaIndex answers "Empty Response").
``response.metadata["percache"]`` says what happened.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Generator, Iterable
from typing import Any

from llama_index.core import Settings
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.response.schema import RESPONSE_TYPE, Response, StreamingResponse
from llama_index.core.indices.base import BaseIndex
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle

from percache_core import (
    Answer,
    Chunk,
    PerCache,
    PerCacheConfig,
    StorageWriteError,
    WarmReport,
    chunk_sources,
    combined_source,
)

from .embedding import PerCacheEmbedding
from .llm import PerCacheLlamaCPP, cache_scope, iterate_in_scope
from .nodes import node_chunks, record_chunks

logger = logging.getLogger(__name__)


def llm_identity(llm: Any) -> str:
    """A text that tells LLMs (class and settings) apart, for binding stored answers."""
    try:
        settings = llm.to_json()
    except Exception:  # not a serialisable LlamaIndex component
        settings = repr(getattr(llm, "metadata", llm))
    return f"{type(llm).__module__}.{type(llm).__qualname__}:{settings}"


def synthesizer_identity(engine: RetrieverQueryEngine, llm: Any) -> str:
    """A text that tells response synthesizers apart: class, response mode and the text
    of every prompt template the engine uses (as formatted for *llm*)."""
    synthesizer = engine._response_synthesizer
    parts = [f"{type(synthesizer).__module__}.{type(synthesizer).__qualname__}"]
    parts.append(str(getattr(synthesizer, "_response_mode", "")))
    for name, prompt in sorted(engine.get_prompts().items()):
        try:
            template = prompt.get_template(llm=llm)
        except TypeError:
            template = prompt.get_template()
        partials = sorted((str(k), str(v)) for k, v in getattr(prompt, "kwargs", {}).items())
        parts.append(f"{name}={template!r}{partials!r}")
    return "|".join(parts)


def _indexed_nodes(index: BaseIndex) -> tuple[str, ...] | None:
    """The node ids of a vector index's structure (None for indexes without one)."""
    nodes = getattr(getattr(index, "index_struct", None), "nodes_dict", None)
    return tuple(nodes) if isinstance(nodes, dict) else None


def _default_llm() -> Any:
    """``Settings.llm`` when one was set, else None (LlamaIndex's default needs OpenAI)."""
    return getattr(Settings, "_llm", None)


def _metadata(answer: Answer) -> dict[str, Any]:
    return {
        "source": answer.source,
        "similarity": answer.similarity,
        "matched_question": answer.matched_question,
        "reused_tokens": answer.reused_tokens,
        "prefilled_tokens": answer.prefilled_tokens,
        "ttft_s": answer.ttft_s,
        "latency_s": answer.latency_s,
    }


class PerCacheQueryEngine(BaseQueryEngine):
    """A query engine that answers from PerCache first, and otherwise as the app's engine.

    Build it with :meth:`from_index`, which takes the keyword arguments of
    ``index.as_query_engine()``.
    """

    def __init__(
        self,
        *,
        index: BaseIndex,
        percache: PerCache,
        llm: Any,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._index = index
        self._llm = llm
        self._engine_kwargs = dict(engine_kwargs or {})
        self._inner = index.as_query_engine(llm=llm, **self._engine_kwargs)
        self._indexed = _indexed_nodes(index)
        super().__init__(callback_manager=self._inner.callback_manager)
        self._percache = percache
        self._uses_states = isinstance(llm, PerCacheLlamaCPP)
        self._unforgotten: set[str] = set()  # deleted nodes whose removal from PerCache failed
        percache.caller.serves_app()  # the app's engine lays out the prompts
        percache.caller.retrieves_with(self._passages)  # idle work rebuilds requests with this engine's retriever
        if self._uses_states:  # idle work predicts from the index's nodes (embedded then, not here)
            self._record(self._indexed or ())

    def _current_engine(self) -> RetrieverQueryEngine:
        """The app's engine; built again (with any prompts updated since) when nodes were
        inserted or deleted (an engine's retriever keeps the node ids it was built with).
        Deleted nodes leave PerCache too (``PerCache.delete_documents``): their text, the
        answers made from them and the states that may hold them."""
        indexed = _indexed_nodes(self._index)
        deleted = set(self._unforgotten)
        if indexed != self._indexed:
            if indexed is not None and self._indexed is not None:
                deleted |= set(self._indexed) - set(indexed)
            prompts = self._inner.get_prompts()
            self._inner = self._index.as_query_engine(llm=self._llm, **self._engine_kwargs)
            self._inner.update_prompts(prompts)
            if self._uses_states and indexed is not None:
                self._record(set(indexed) - set(self._indexed or ()))
            self._indexed = indexed
        self._forget(deleted)
        return self._inner

    def _record(self, node_ids: Iterable[str]) -> None:
        """Give idle work the text of these nodes of the index's docstore (those it holds)."""
        docstore = getattr(self._index, "docstore", None)
        nodes = [docstore.get_node(i, raise_error=False) for i in node_ids] if docstore is not None else []
        record_chunks(self._percache, node_chunks([NodeWithScore(node=n) for n in nodes if n is not None]))

    def _forget(self, deleted: set[str]) -> None:
        """Delete these nodes from PerCache; after a storage failure (logged: answers stay
        exact, as bindings name the nodes) they are tried again at the next question."""
        self._unforgotten = set()
        if not deleted:
            return
        try:
            self._percache.delete_documents(deleted)
        except StorageWriteError as error:
            self._unforgotten = deleted
            logger.warning("deleted nodes not yet removed from the cache (%s); tried again later", error)

    @classmethod
    def from_index(
        cls,
        index: BaseIndex,
        *,
        cache_dir: str | os.PathLike[str],
        llm: Any = None,
        config: PerCacheConfig | None = None,
        **kwargs: Any,
    ) -> PerCacheQueryEngine:
        """Like ``index.as_query_engine(llm=llm, **kwargs)`` (``similarity_top_k``,
        ``response_mode``, ``text_qa_template``, ``streaming``, ``node_postprocessors``,
        ...), with a PerCache in *cache_dir*. Without an LLM (and no ``Settings.llm``), the
        bundled Gemma 3 270M through :class:`PerCacheLlamaCPP`. Chunk states need a
        :class:`PerCacheLlamaCPP`; with any other LLM only exact answers are reused.

        Args:
            index: the LlamaIndex index the app queries.
            cache_dir: the PerCache folder.
            llm: the LLM (default: ``Settings.llm``, else :class:`PerCacheLlamaCPP`).
            config: PerCache's settings (``similarity_top_k`` sets ``top_k``).
            **kwargs: ``as_query_engine``'s keywords.

        Returns:
            The query engine (close it, or its cache, when done).

        Raises:
            TypeError: *index* is not a LlamaIndex index.

        >>> engine = PerCacheQueryEngine.from_index(index, cache_dir="cache", similarity_top_k=3)  # doctest: +SKIP
        """
        if not isinstance(index, BaseIndex):
            raise TypeError(f"index must be a LlamaIndex index, got {type(index).__name__}")
        llm = llm or _default_llm() or PerCacheLlamaCPP()
        config = config or PerCacheConfig()
        if "similarity_top_k" in kwargs:
            config = config.replace(top_k=kwargs["similarity_top_k"])
        embed_model = getattr(index, "_embed_model", None)
        embedder = embed_model.embedder if isinstance(embed_model, PerCacheEmbedding) else None
        if isinstance(llm, PerCacheLlamaCPP):
            percache = PerCache.open(cache_dir, config=config, embedder=embedder, engine=llm.engine)
        else:
            percache = PerCache.open(cache_dir, config=config.replace(chunk_states=False), embedder=embedder)
        return cls(index=index, percache=percache, llm=llm, engine_kwargs=kwargs)

    @property
    def percache(self) -> PerCache:
        """The cache behind this engine (for ``stats()``, ``close()``, ...)."""
        return self._percache

    def warm(self, **kwargs: Any) -> WarmReport:
        """One idle round: PerCache predicts questions (from the nodes retrieved so far and
        from recent questions) and this engine answers each as the app's engine does, so
        the stored answers and states are the ones its queries use (see
        ``PerCache.warm``). Nothing with an LLM that is not llama.cpp (the predictions
        would come from another model).

        Args:
            **kwargs: ``PerCache.warm``'s keywords (``max_seconds``, ``max_predictions``, ...).

        Returns:
            The round's :class:`~percache_core.WarmReport` (strategy ``"none"`` with another LLM).

        >>> report = engine.warm(max_seconds=60)   # doctest: +SKIP
        >>> engine.query(report.predicted[0]).metadata["percache"].get("source")  # doctest: +SKIP
        'qa_bank'
        """
        if not self._uses_states:
            logger.warning(
                "idle prediction needs the llama.cpp model that answers: %s is not one",
                type(self._llm).__name__,
            )
            return WarmReport(strategy="none")
        self._current_engine()  # nodes deleted since the last question leave PerCache first
        return self._percache.warm(answer=self._answer_predicted, **kwargs)

    def start_worker(self, **kwargs: Any) -> Any:
        """Start PerCache's background idle worker, answering its predicted questions
        through this engine (see :meth:`warm` and ``PerCache.start_worker``).

        Args:
            **kwargs: ``PerCache.start_worker``'s keywords (``idle_after_s``, ...).

        Returns:
            The worker, or None with an LLM that is not llama.cpp.

        >>> engine.start_worker(idle_after_s=30)   # doctest: +SKIP
        """
        if not self._uses_states:
            logger.warning(
                "idle prediction needs the llama.cpp model that answers: %s is not one",
                type(self._llm).__name__,
            )
            return None
        return self._percache.start_worker(answer=self._answer_predicted, **kwargs)

    def _answer_predicted(self, question: str) -> bool:
        """Answer a predicted question as :meth:`query` would and store the answer (not a
        user question: it joins no history); whether a new answer was stored."""
        inner = self._current_engine()
        bundle = QueryBundle(question)
        nodes = inner.retrieve(bundle)
        if not nodes or not self._percache.config.tiers.qa_bank:
            return False
        chunks = node_chunks(nodes)
        binding = self._binding(chunks)
        if self._percache.caller.find(question, binding=binding) is not None:
            return False
        response = self._synthesize(bundle, nodes, chunks, binding, time.perf_counter())
        if isinstance(response, StreamingResponse):
            for _ in response.response_gen:  # the answer is stored when the stream ends
                pass
        return self._percache.caller.find(question, binding=binding) is not None

    def _passages(self, question: str, count: int) -> list[str]:
        """The texts the LLM sees of the nodes this engine retrieves for *question* (at
        most *count*), for idle work's agreement checks (``pc.caller.retrieves_with``)."""
        return [c.text for c in node_chunks(self._current_engine().retrieve(QueryBundle(question)))][:count]

    def _binding(self, chunks: list[Chunk]) -> str:
        """What decides this engine's answer besides the question: the LLM, the response
        synthesizer and the retrieved nodes' ids and texts (``node_chunks``), in order."""
        sources = json.dumps(chunk_sources(chunks))
        payload = "\x1f".join((llm_identity(self._llm), synthesizer_identity(self._inner, self._llm), sources))
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]

    def _get_prompt_modules(self) -> dict[str, Any]:
        return {"inner": self._inner}

    def retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        """The nodes the app's own query engine retrieves for the query.

        Args:
            query_bundle: the query.

        Returns:
            The retrieved nodes, as the inner engine returns them.

        >>> engine.retrieve(QueryBundle("When is the review?"))   # doctest: +SKIP
        """
        return self._current_engine().retrieve(query_bundle)

    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        started = time.perf_counter()
        inner = self._current_engine()
        nodes = inner.retrieve(query_bundle)
        if not nodes:  # LlamaIndex's own empty response; nothing to store
            return self._with_info(inner.synthesize(query_bundle, nodes), {"source": "full"})
        chunks = node_chunks(nodes)
        binding = self._binding(chunks)
        question = query_bundle.query_str
        hit = self._percache.caller.lookup(question, binding=binding)
        if hit is not None:
            return self._stored_response(hit, nodes)
        return self._synthesize(query_bundle, nodes, chunks, binding, started)

    def _stored_response(self, hit: Answer, nodes: list[NodeWithScore]) -> RESPONSE_TYPE:
        metadata: dict[str, Any] = {n.node.node_id: n.node.metadata for n in nodes}
        metadata["percache"] = _metadata(hit)
        if self._inner._response_synthesizer._streaming:
            return StreamingResponse(response_gen=iter([hit.text]), source_nodes=nodes, metadata=metadata)
        return Response(hit.text, source_nodes=nodes, metadata=metadata)

    @staticmethod
    def _with_info(response: RESPONSE_TYPE, info: dict[str, Any]) -> RESPONSE_TYPE:
        response.metadata = {**(response.metadata or {}), "percache": info}
        return response

    def _synthesize(
        self,
        query_bundle: QueryBundle,
        nodes: list[NodeWithScore],
        chunks: list[Chunk],
        binding: str,
        started: float,
    ) -> RESPONSE_TYPE:
        """The app's engine's answer from *nodes* (their *chunks* recorded as knowledge),
        with the LLM's calls through the chunk states; stored under *binding*."""
        record_chunks(self._percache, chunks)
        documents = [c.text for c in chunks] if self._uses_states else []
        with cache_scope(self._percache, documents, query_bundle.query_str) as scope:
            response = self._inner.synthesize(query_bundle, nodes)
        question = query_bundle.query_str
        info: dict[str, Any] = {"source": "full", "llm_calls": 0, "reused_tokens": 0, "prefilled_tokens": 0}

        def account() -> None:  # what the LLM calls restored and prefilled
            info.update(
                source=combined_source(scope.answers),
                llm_calls=len(scope.answers),
                reused_tokens=scope.reused_tokens,
                prefilled_tokens=scope.prefilled_tokens,
                latency_s=time.perf_counter() - started,
            )

        if isinstance(response, StreamingResponse):
            original = response.response_gen

            def pieces() -> Generator[str, None, None]:
                text = ""
                for piece in iterate_in_scope(original, scope):
                    text += piece
                    yield piece
                account()
                self._remember(question, text, nodes, binding)

            response.response_gen = pieces()
            return self._with_info(response, info)
        account()
        self._remember(question, response.response, nodes, binding)
        return self._with_info(response, info)

    def _remember(self, question: str, text: str | None, nodes: list[NodeWithScore], binding: str) -> None:
        if self._percache.config.tiers.qa_bank and text and text.strip():
            ids = [n.node.node_id for n in nodes]
            self._percache.caller.remember(question, text, chunk_ids=ids, binding=binding)

    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        return await asyncio.to_thread(self._query, query_bundle)

    def close(self) -> None:
        """Close the cache (the engine can no longer answer).

        >>> engine.close()   # doctest: +SKIP
        """
        self._percache.close()


__all__ = ["PerCacheQueryEngine"]
