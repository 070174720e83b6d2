"""``PerCacheChatModel``: a LangChain chat model on PerCache's llama.cpp engine.

Messages are laid out as stock ``llama_cpp.Llama.create_chat_completion`` lays them out
(the GGUF file's chat template, or llama-cpp-python's ``llama-2`` fallback for a model
without one; ``chat_template`` names one of llama.cpp's built-in templates instead, such as
``"gemma"``) and the prompt is continued like ``PerCacheLLM``'s: stock's text, the same
with or without stored chunk states, reusing the states of documents a ``PerCacheRetriever``
returned. A state is also kept after the system message (a new session restores it) and
after the conversation before the new message; the next turn keeps what the context holds
of this turn's prompt, as stock ``llama_cpp.Llama`` does.

``stream()`` goes through LangChain's LLM cache as ``invoke()`` does: a cached answer is
streamed as one chunk, and a streamed answer is stored under the key ``invoke()`` uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.caches import BaseCache
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.globals import get_llm_cache
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.load import dumps
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, field_validator

from percache_core import Answer, AnswerStream, ChatPrompt, chat_prompt

from .llm import complete, decoding_of, generation_settings
from .recorder import as_percache

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


def message_pairs(messages: list[BaseMessage]) -> list[tuple[str, str]]:
    """(role, text) of LangChain messages, in the chat template's role names."""
    pairs = []
    for message in messages:
        role = getattr(message, "role", None) or _ROLES.get(message.type, message.type)
        pairs.append((str(role), message.text))
    return pairs


def _without_ids(messages: list[BaseMessage]) -> list[BaseMessage]:
    """The messages as LangChain keys its cache (message ids left out)."""
    return [m.model_copy(update={"id": None}) if getattr(m, "id", None) is not None else m for m in messages]


def _usage(answer: Answer | None) -> UsageMetadata | None:
    if answer is None:
        return None
    prompt_tokens = answer.reused_tokens + answer.prefilled_tokens
    generated = answer.generated_tokens
    return UsageMetadata(
        input_tokens=prompt_tokens,
        output_tokens=generated,
        total_tokens=prompt_tokens + generated,
        input_token_details=InputTokenDetails(cache_read=answer.reused_tokens),  # restored, not prefilled
    )


class PerCacheChatModel(BaseChatModel):
    """A chat model on the PerCache's engine and settings (``max_new_tokens``, alias
    ``max_tokens``, and ``temperature`` override them); a call's ``stop`` strings (else
    ``stop``) and the chat format's own end the answer (the configured stop strings are
    for PerCache's own completion prompt, not chats). The reply is llama.cpp's text as
    decoded, as stock ``create_chat_completion`` returns it.

    >>> chat = PerCacheChatModel(percache=pc, max_new_tokens=64)        # doctest: +SKIP
    >>> (retriever | prompt | chat).invoke({"question": "When is the rehearsal?"})  # doctest: +SKIP
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    percache: Any
    max_new_tokens: int | None = Field(default=None, gt=0, alias="max_tokens")
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    stop: list[str] | None = Field(default=None, description="stop strings of calls that give none")
    chat_template: str | None = None

    @field_validator("percache")
    @classmethod
    def _check_percache(cls, value: Any) -> Any:
        return as_percache(value)

    @property
    def _llm_type(self) -> str:
        return "percache-chat-llama-cpp"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        settings = generation_settings(self.percache, self.max_new_tokens, self.temperature)
        return {**settings, "chat_template": self.chat_template}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        settings = self._identifying_params
        params.update(
            ls_model_name=kwargs.get("model") or self._model_name,
            ls_temperature=settings["temperature"],
            ls_max_tokens=settings["max_new_tokens"],
        )
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    @property
    def _model_name(self) -> str:
        return self.percache.caller.text_model.model_name

    def prompt(self, messages: list[BaseMessage]) -> str:
        """The prompt string the model continues for *messages* (the model's chat template).

        Args:
            messages: the chat so far.

        Returns:
            The prompt string.

        >>> chat.prompt([HumanMessage("Hi")])   # doctest: +SKIP
        """
        return self._chat(messages).text

    def _chat(self, messages: list[BaseMessage]) -> ChatPrompt:
        return chat_prompt(self.percache.caller.text_model, message_pairs(messages), template=self.chat_template)

    def _pieces(self, messages: list[BaseMessage], stop: list[str] | None) -> AnswerStream:
        chat = self._chat(messages)
        stops = list(stop if stop is not None else self.stop or []) + list(chat.stop)
        # states are kept after the system message (a new session with it restores it) and
        # after the message before the last one (the conversation so far); the previous
        # turn's prompt itself stays in the context for the next turn. Every cut is a call
        # of its own, so a cut after every message would slow long chats down.
        pairs = message_pairs(messages)
        contents = [text for role, text in pairs[:1] if role == "system"] + [text for _, text in pairs[-2:-1]]
        decoding = decoding_of(self._identifying_params, stops)
        question = next((text for role, text in reversed(pairs) if role == "user"), None)
        return complete(self.percache, chat.text, decoding, keep_after=contents, add_bos=chat.add_bos, question=question)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        stream = self._pieces(messages, stop)
        text = "".join(stream)
        message = AIMessage(
            content=text, usage_metadata=_usage(stream.answer), response_metadata={"model_name": self._model_name}
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        cache = self._llm_cache()
        key = (dumps(_without_ids(messages)), self._get_llm_string(stop=stop, **kwargs)) if cache is not None else None
        if cache is not None and key is not None:
            cached = cache.lookup(*key)
            if cached:
                text = cached[0].text
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=text))
                if run_manager is not None:
                    run_manager.on_llm_new_token(text, chunk=chunk)
                yield chunk
                return
        stream = self._pieces(messages, stop)
        text = ""
        for piece in stream:
            text += piece
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager is not None:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield ChatGenerationChunk(
            message=AIMessageChunk(
                content="",
                usage_metadata=_usage(stream.answer),
                response_metadata={"model_name": self._model_name},
                chunk_position="last",
            )
        )
        if cache is not None and key is not None:
            cache.update(*key, [ChatGeneration(message=AIMessage(content=text))])

    def _llm_cache(self) -> BaseCache | None:
        """The LLM cache ``invoke`` uses (None when caching is off for this model)."""
        if self.cache is False:
            return None
        return self.cache if isinstance(self.cache, BaseCache) else get_llm_cache()
