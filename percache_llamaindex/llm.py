"""``PerCacheLlamaCPP``: a LlamaIndex LLM on llama.cpp whose answers do not depend on a cache.

Every prompt, whoever formatted it, is tokenized whole and prefilled as one call would
(``percache_core.serving.prompting.lay_out_text``). Inside a
:class:`~percache_llamaindex.PerCacheQueryEngine`, each LLM call (the one call of
``compact``, every call of ``refine`` and ``tree_summarize``) restores the stored KV state
of the longest known leading part of its prompt, keeps the states that end a retrieved
node, and an identical prompt is answered without the model; elsewhere
(``index.as_query_engine(llm=llm)``, ``llm.complete``) the prompt runs in one call without
stored states. Cuts are made only into pieces at least as long as the engine's exact piece
size (a start-up self-check), so the text is the same either way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from llama_index.core.base.llms.generic_utils import (
    completion_response_to_chat_response,
    stream_completion_response_to_chat_response,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from pydantic import Field, PrivateAttr, model_validator

from percache_core import (
    Answer,
    AnswerStream,
    ChatPrompt,
    Decoding,
    Engine,
    PerCache,
    PerCacheConfig,
    Sampling,
    TextPrompt,
    UncachedCompletion,
    chat_prompt,
    open_engine,
)

T = TypeVar("T")


@dataclass
class CacheScope:
    """The cache that LLM calls use inside a :func:`cache_scope` block, and their answers."""

    percache: PerCache
    documents: tuple[str, ...]
    question: str | None = None  # the user's query the calls answer (learned with the prompts' shape)
    answers: list[Answer] = field(default_factory=list)

    @property
    def reused_tokens(self) -> int:
        return sum(a.reused_tokens for a in self.answers)

    @property
    def prefilled_tokens(self) -> int:
        return sum(a.prefilled_tokens for a in self.answers)


_scope: ContextVar[CacheScope | None] = ContextVar("percache_llamaindex_cache_scope", default=None)


@contextmanager
def cache_scope(percache: PerCache, documents: Sequence[str], question: str | None = None) -> Iterator[CacheScope]:
    """Within this block, LLM calls reuse and keep *percache*'s chunk states; a state is
    kept where one of *documents* (the retrieved nodes' texts) ends in the prompt; the
    calls answer *question* (the user's query, where known)."""
    scope = CacheScope(percache, tuple(documents), question)
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


def iterate_in_scope(items: Iterator[T], scope: CacheScope) -> Iterator[T]:
    """*items* with *scope* in force while each is produced: for a streaming response that
    is consumed after its :func:`cache_scope` block ended (its LLM call starts only then)."""
    while True:
        token = _scope.set(scope)
        try:
            item = next(items)
        except StopIteration:
            return
        finally:
            _scope.reset(token)
        yield item


class PerCacheLlamaCPP(CustomLLM):
    """A GGUF model (default: the bundled Gemma 3 270M) as a LlamaIndex LLM.

    ``complete``/``stream_complete``/``chat``/``stream_chat`` and their async forms. Chat
    messages are laid out as stock ``llama_cpp.Llama.create_chat_completion`` lays them out
    (the GGUF file's chat template, or llama-cpp-python's ``llama-2`` fallback for a file
    without one; ``chat_template`` names one of llama.cpp's built-in templates instead,
    e.g. ``"gemma"``), unless a ``messages_to_prompt`` is given. The defaults suit the bundled small base model:
    greedy decoding and answers that end at a line break (``stop=["\\n"]``).

    >>> llm = PerCacheLlamaCPP(max_new_tokens=32)            # doctest: +SKIP
    >>> llm.complete("The capital of France is").text        # doctest: +SKIP
    """

    model_path: str | None = Field(default=None, description="GGUF file; None: the bundled model")
    max_new_tokens: int = Field(default=128, gt=0, description="most tokens of one answer")
    n_ctx: int = Field(default=2048, gt=0, description="llama.cpp context length in tokens")
    temperature: float = Field(default=0.0, ge=0.0, le=10.0, description="0: greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int = Field(default=0, description="sampling seed (temperature > 0)")
    stop: list[str] = Field(default_factory=lambda: ["\n"], description="stop strings (not in the text)")
    chat_template: str | None = Field(
        default=None, description="a llama.cpp built-in template name or template text; None: the GGUF's"
    )
    prompt_lookup: bool = Field(
        default=False, description="verify drafts from the prompt while decoding (greedy only)"
    )
    _engine: Engine | None = PrivateAttr(default=None)
    _uncached: UncachedCompletion | None = PrivateAttr(default=None)

    _own_chat_layout: bool = PrivateAttr(default=False)

    def __init__(self, engine: Engine | None = None, **kwargs: Any) -> None:
        own_chat_layout = kwargs.get("messages_to_prompt") is not None
        super().__init__(**kwargs)
        self._engine = engine
        self._own_chat_layout = own_chat_layout

    @model_validator(mode="after")
    def _check_stop(self) -> PerCacheLlamaCPP:
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        return self

    @classmethod
    def class_name(cls) -> str:
        """LlamaIndex's name of this component.

        Returns:
            ``"PerCacheLlamaCPP"``.

        >>> PerCacheLlamaCPP.class_name()
        'PerCacheLlamaCPP'
        """
        return "PerCacheLlamaCPP"

    @property
    def engine(self) -> Engine:
        """The llama.cpp engine (loaded on first use, as a cache loads its own)."""
        if self._engine is None:
            self._engine = open_engine(self.model_path, PerCacheConfig(n_ctx=self.n_ctx))
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        """LlamaIndex's description of the model: its context window, answer length and
        name (a completion model)."""
        return LLMMetadata(
            context_window=self.n_ctx,
            num_output=self.max_new_tokens,
            model_name=self.model_path or "gemma-3-270m-q4_k_m.gguf",
            is_chat_model=False,
        )

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """*messages* as the prompt ``chat`` completes: the given ``messages_to_prompt``,
        else as stock ``llama_cpp.Llama.create_chat_completion`` lays them out (see
        ``percache_core.serving.prompting.chat_prompt``).

        Args:
            messages: the chat so far.

        Returns:
            The prompt string.

        >>> llm.chat_prompt([ChatMessage(role="user", content="Hi")])   # doctest: +SKIP
        """
        return self._chat(messages).text

    def _chat(self, messages: Sequence[ChatMessage]) -> ChatPrompt:
        if self._own_chat_layout:
            return ChatPrompt(self.messages_to_prompt(messages), add_bos=None)
        pairs = [(m.role.value, m.content or "") for m in messages]
        return chat_prompt(self.engine, pairs, template=self.chat_template)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """The model's reply to *messages* (through the cache of the enclosing
        :func:`cache_scope`, else uncached), as stock LlamaIndex ``LlamaCPP`` gives it.

        Args:
            messages: the chat so far.
            **kwargs: LlamaIndex's call options (unused).

        Returns:
            The reply.

        >>> llm.chat([ChatMessage(role="user", content="Hi")]).message.content   # doctest: +SKIP
        """
        chat = self._chat(messages)
        text = "".join(self._pieces(chat.text, _scope.get(), chat))
        return completion_response_to_chat_response(CompletionResponse(text=text))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """:meth:`chat`, streamed.

        Args:
            messages: the chat so far.
            **kwargs: LlamaIndex's call options (unused).

        Returns:
            The reply's responses, each with the text so far and its delta.

        >>> "".join(r.delta for r in llm.stream_chat(messages))   # doctest: +SKIP
        """
        chat = self._chat(messages)
        return stream_completion_response_to_chat_response(self._responses(self._pieces(chat.text, _scope.get(), chat)))

    def _uncached_completion(self) -> UncachedCompletion:
        if self._uncached is None:
            self._uncached = UncachedCompletion(self.engine)
        return self._uncached

    def _pieces(self, prompt: str, scope: CacheScope | None, chat: ChatPrompt | None = None) -> Iterator[str]:
        """The completion's text pieces, produced by a thread of their own (an abandoned
        stream never keeps the model from other calls); through the cache of *scope* (the
        caller's :func:`cache_scope`) when it runs on this LLM's engine. For a *chat*, its
        BOS rule and stop strings apply too."""
        sampling = Sampling(self.temperature, self.top_p, self.seed)
        add_bos = None if chat is None else chat.add_bos
        stop = self.stop + ([] if chat is None else list(chat.stop))
        if scope is not None and scope.percache.caller.runs_on(self.engine):
            decoding = Decoding(self.max_new_tokens, sampling, stop, prompt_lookup=self.prompt_lookup)
            stream = scope.percache.caller.complete(
                prompt, documents=scope.documents, decoding=decoding, add_bos=add_bos, stream=True, question=scope.question
            )  # llama.cpp's text as decoded (trim=False), as stock LlamaCPP gives it
            assert isinstance(stream, AnswerStream)
            yield from stream
            if stream.answer is not None:
                scope.answers.append(stream.answer)
            return
        yield from self._uncached_completion().stream(
            TextPrompt(prompt, add_bos=add_bos),
            max_new_tokens=self.max_new_tokens,
            sampling=sampling,
            stop=stop,
            prompt_lookup=self.prompt_lookup,
        )

    def _prompt(self, prompt: str, formatted: bool) -> str:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt must be a non-empty string")
        return prompt if formatted else self.completion_to_prompt(prompt)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """The model's completion of *prompt* (through the cache of the enclosing
        :func:`cache_scope`, else uncached), as stock LlamaIndex ``LlamaCPP`` gives it.

        Args:
            prompt: the prompt (non-empty).
            formatted: the prompt is final (else ``completion_to_prompt`` formats it).
            **kwargs: LlamaIndex's call options (unused).

        Returns:
            The completion.

        Raises:
            ValueError: an empty prompt.

        >>> llm.complete("The capital of France is").text   # doctest: +SKIP
        """
        pieces = self._pieces(self._prompt(prompt, formatted), _scope.get())
        return CompletionResponse(text="".join(pieces))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """:meth:`complete`, streamed.

        Args:
            prompt: the prompt (non-empty).
            formatted: the prompt is final (else ``completion_to_prompt`` formats it).
            **kwargs: LlamaIndex's call options (unused).

        Returns:
            The completion's responses, each with the text so far and its delta.

        >>> "".join(r.delta for r in llm.stream_complete("Hello"))   # doctest: +SKIP
        """
        # The scope is read now: the generator runs later, outside the caller's block.
        return self._responses(self._pieces(self._prompt(prompt, formatted), _scope.get()))

    @staticmethod
    def _responses(pieces: Iterator[str]) -> CompletionResponseGen:
        """Streamed responses of text *pieces* (the pieces are already under way)."""
        text = ""
        for piece in pieces:
            text += piece
            yield CompletionResponse(text=text, delta=piece)
