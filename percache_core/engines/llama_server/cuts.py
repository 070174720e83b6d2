"""Where a prompt's prefill may be cut on a llama-server without changing its output: the
start-up check of :mod:`percache_core.kv.cuts`, measured through the server's own requests.

A server picks its kernels as llama.cpp in the process does, and its flash attention (on by
default) takes another kernel below 64 rows, so the rules that hold through a server are
measured there: :func:`measure_server_cut_rule` prefills a prompt's pieces the way PerCache
restores a state (a prefix alone, then the whole prompt with ``cache_prompt``) and compares
the first token's top log-probabilities with a fresh prefill's.
"""

from __future__ import annotations

import logging

from ...kv.cuts import PROBE_PROMPT, CutRule, cut_schedules
from ...kv.engine import Decoding, EngineVerdicts
from .server import LlamaServer
from .server_streams import UnexpectedReuse

logger = logging.getLogger(__name__)

_server_verdicts: EngineVerdicts[CutRule | None] = EngineVerdicts(
    "server_cut_rule",
    encode=lambda rule: None if rule is None else [rule.min_tokens, rule.multiple],
    decode=lambda value: None if value is None else CutRule(int(value[0]), int(value[1])),
)
_PROBE_LOGPROBS = 20  # top log-probabilities compared (a proxy for the logits the server keeps)
# a server's flash attention (on by default) takes another kernel below 64 rows: longer
# pieces, so longer prompts (measured here: pieces of 64+ tokens at multiples of 4 gave a
# fresh prefill's output with Gemma 3 270M and SmolLM2-135M, shorter ones did not)
SERVER_CANDIDATES = (CutRule(8, 4), CutRule(16, 4), CutRule(32, 4), CutRule(64, 4), CutRule(64, 16), CutRule(128, 16))
_SERVER_LENGTHS = (401, 406)  # three pieces of 128 fit


def measure_server_cut_rule(server: LlamaServer) -> CutRule | None:
    """The first rule of :data:`SERVER_CANDIDATES` under which *server*'s output does not depend
    on where a prompt's prefill is cut, measured through the server itself (None: none
    holds), once per server and remembered (on disk for a server PerCache started, whose
    flags it knows). A cut is made the way PerCache makes one: a prefill of the prefix
    alone (``n_predict: 0``, nothing reused), then the whole prompt with ``cache_prompt``;
    the reference is the whole prompt with nothing reused. The first token's top
    log-probabilities and the reuse the server reports must agree, for every schedule.
    Takes ``server.lock``; leaves the slot's content unknown.

    >>> measure_server_cut_rule(LlamaServer.start())   # doctest: +SKIP
    CutRule(min_tokens=8, multiple=4)
    """
    known, rule = known_server_cut_rule(server)
    if known:
        return rule
    with server.lock:
        known, rule = known_server_cut_rule(server)
        if known:
            return rule
        tokens = server.tokenize(PROBE_PROMPT + "\n\n" + PROBE_PROMPT + "\n\n" + PROBE_PROMPT + "\n\n" + PROBE_PROMPT, True)
        prompts = [tokens[:n] for n in _SERVER_LENGTHS if n <= len(tokens)]
        references = [_server_logprobs(server, prompt, []) for prompt in prompts]
        rule = next(
            (
                candidate for candidate in SERVER_CANDIDATES
                if all(
                    _server_logprobs(server, prompt, [len(piece) for piece in pieces[:-1]]) == reference
                    for prompt, reference in zip(prompts, references)
                    for pieces in cut_schedules(prompt, candidate)
                )
            ),
            None,
        )
        _server_verdicts.keep(server, rule)
    if rule is None:
        logger.warning("the server's output depends on where a prompt is cut: no chunk states are kept for it")
    return rule


def known_server_cut_rule(server: LlamaServer) -> tuple[bool, CutRule | None]:
    """Whether :func:`measure_server_cut_rule` has run for *server*, and its rule."""
    return _server_verdicts.known(server)


def _server_logprobs(server: LlamaServer, prompt: list[int], piece_lengths: list[int]) -> object:
    """The first token's top log-probabilities of *prompt* prefilled in pieces of
    *piece_lengths* (then the rest), or a marker when the server reused other than
    planned."""
    end = 0
    try:
        for length in piece_lengths:
            end += length
            for _ in server.complete(prompt[:end], Decoding(0), cache_prompt=end > length, expected_cached=end - length):
                pass
        for _ in server.complete(
            prompt, Decoding(1), cache_prompt=bool(end), n_probs=_PROBE_LOGPROBS, expected_cached=end
        ):
            pass
    except UnexpectedReuse as error:
        return ("reused", error.expected, error.cached)
    return server.last.top_logprobs
