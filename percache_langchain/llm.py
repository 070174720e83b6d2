"""``PerCacheLLM``: a LangChain LLM on PerCache's llama.cpp engine.

The prompt string, whatever template made it, is continued exactly as the model does
without a cache (``pc.caller.complete``): tokenized whole and prefilled as one call
would, restoring the stored state of its longest known leading part. States are kept where
a document that a ``PerCacheRetriever`` of the same PerCache returned ends in the prompt;
that choice never changes the text. An identical prompt is answered without the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.llms import LLM
from langchain_core.outputs import GenerationChunk
from pydantic import ConfigDict, Field, field_validator

from percache_core import AnswerStream, Decoding, PerCache, Sampling

from .recorder import as_percache, recorder_for


def generation_settings(percache: PerCache, max_new_tokens: int | None, temperature: float | None) -> dict[str, Any]:
    """The settings one call runs with (the PerCache's where not given), for
    ``_identifying_params`` (so LangChain's cache keys tell them apart) and for the call."""
    config = percache.config
    return {
        "model": percache.caller.model_id(),
        "max_new_tokens": max_new_tokens or config.engine.max_new_tokens,
        "temperature": config.engine.temperature if temperature is None else temperature,
        "top_p": config.engine.top_p,
        "seed": config.engine.seed,
    }


def decoding_of(settings: dict[str, Any], stop: Sequence[str], trim: bool = False) -> Decoding:
    """The :class:`~percache_core.Decoding` of :func:`generation_settings`' *settings* with
    *stop* (the app's stop strings only: PerCache's configured ones are for its own prompt)
    and *trim* (drop the white space around the answer, for chat replies; without it the
    text is llama.cpp's as decoded)."""
    sampling = Sampling(settings["temperature"], settings["top_p"], settings["seed"])
    return Decoding(settings["max_new_tokens"], sampling, list(stop), trim=trim)


def complete(
    percache: PerCache,
    prompt: str,
    decoding: Decoding,
    keep_after: Sequence[str] = (),
    add_bos: bool | None = None,
    question: str | None = None,
) -> AnswerStream:
    """*prompt* continued through *percache*'s chunk states with *decoding*: the text
    pieces (joined, they are the text ``invoke`` returns), then ``.answer``. States are
    kept after the documents a retriever of *percache* returned and after the texts
    *keep_after* (a chat's messages). *add_bos*: see ``pc.caller.complete``. The user's
    question is the one a retriever of *percache* recorded in the prompt, else *question*
    (a chat's last user message)."""
    recorder = recorder_for(percache)
    documents = [d.page_content for d in recorder.documents_in(prompt)]
    documents += [text for text in keep_after if text.strip()]
    question = recorder.question_in(prompt) or question
    stream = percache.caller.complete(
        prompt, documents=documents, decoding=decoding, add_bos=add_bos, stream=True, question=question
    )
    assert isinstance(stream, AnswerStream)
    return stream


class PerCacheLLM(LLM):
    """Generates with the PerCache's engine and decoding settings (greedy by default;
    ``max_new_tokens`` and ``temperature`` override them for this LLM). Stop strings are
    the app's only, as LangChain's ``LlamaCpp`` has them: a call's ``stop``, else this
    LLM's ``stop``, else none (PerCache's configured stop strings belong to its own
    prompt and are never added), so the text is what stock llama.cpp gives the same prompt.

    >>> llm = PerCacheLLM(percache=pc, max_new_tokens=48, stop=["\\n"])   # doctest: +SKIP
    >>> (retriever | prompt | llm).invoke("When is the rehearsal?")   # doctest: +SKIP
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    percache: Any
    max_new_tokens: int | None = Field(default=None, gt=0)
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    stop: list[str] | None = Field(default=None, description="stop strings of calls that give none (default: none)")

    @field_validator("percache")
    @classmethod
    def _check_percache(cls, value: Any) -> PerCache:
        return as_percache(value)

    @property
    def _llm_type(self) -> str:
        return "percache-llama-cpp"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**generation_settings(self.percache, self.max_new_tokens, self.temperature), "stop": self.stop}

    def _decoding(self, stop: list[str] | None) -> Decoding:
        """One call's decoding: the call's *stop*, else this LLM's, else none."""
        return decoding_of(self._identifying_params, stop if stop is not None else self.stop or [])

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return "".join(complete(self.percache, prompt, self._decoding(stop)))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for piece in complete(self.percache, prompt, self._decoding(stop)):
            chunk = GenerationChunk(text=piece)
            if run_manager is not None:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
