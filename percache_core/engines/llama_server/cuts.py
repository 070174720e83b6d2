"""Where a prompt's prefill may be cut on a llama-server without changing its output: the
start-up check of :mod:`percache_core.kv.cuts`, measured through the server's own requests.

A server picks its kernels as llama.cpp in the process does, and its flash attention (on by
default) takes another kernel below 64 rows, so the rules that hold through a server are
measured there: :func:`measure_server_cut_rule` prefills a prompt's pieces the way PerCache
restores a state (a prefix alone, then the whole prompt with ``cache_prompt``) and compares
the first token's top log-probabilities with a fresh prefill's.

The last candidate is "multiples of the server's micro-batch": on a CUDA build of this
llama.cpp a restored prefix plus the rest's prefill equals a fresh prefill only where the
cut is a multiple of the batch (measured on an H200 with 512: DESIGN 5b), so a GPU server
still gets the states it can restore exactly. It is probed on a prompt long enough for two
such cuts; a candidate no probe prompt can be cut under is not taken.
"""

from __future__ import annotations

import logging

from ...kv.cuts import PROBE_PROMPT, CutRule, cut_schedules
from ...kv.engine import Decoding, EngineVerdicts
from ...kv.probe_text import probe_tokens
from .server import InSlot, LlamaServer
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
_BATCH_PROBE_EXTRA = 77  # a batch-multiple rule's probe: two batches and a short last one


def server_candidates(n_ubatch: int) -> tuple[CutRule, ...]:
    """The rules measured on a server whose micro-batch is *n_ubatch*, in order: the small
    ones of :data:`SERVER_CANDIDATES`, then multiples of the batch itself.

    >>> server_candidates(512)[-1]
    CutRule(min_tokens=512, multiple=512)
    """
    return (*SERVER_CANDIDATES, CutRule(n_ubatch, n_ubatch))


def measure_server_cut_rule(server: LlamaServer) -> CutRule | None:
    """The first rule of :func:`server_candidates` under which *server*'s output does not depend
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
        probes = _Probes(server, [tokens[:n] for n in _SERVER_LENGTHS if n <= len(tokens)])
        rule = next((candidate for candidate in server_candidates(server.n_ubatch) if probes.hold(candidate)), None)
        _server_verdicts.keep(server, rule)
    if rule is None:
        logger.warning("the server's output depends on where a prompt is cut: no chunk states are kept for it")
    return rule


class _Probes:
    """The probe prompts of *server* and their fresh prefills' log-probabilities (a rule
    whose cuts none of them can hold gets a prompt of two batches and a short last one,
    where the server's context allows)."""

    def __init__(self, server: LlamaServer, prompts: list[list[int]]) -> None:
        self.server = server
        self.prompts = prompts
        self._references: dict[int, object] = {}

    def hold(self, candidate: CutRule) -> bool:
        """Whether every way :func:`cut_schedules` cuts a probe prompt under *candidate*
        gives the fresh prefill's output (False where no prompt can be cut under it)."""
        prompts = [p for p in self.prompts if cut_schedules(p, candidate)]
        length = 2 * candidate.min_tokens + _BATCH_PROBE_EXTRA
        if not prompts and length < self.server.n_ctx:
            long_prompt = probe_tokens(self.server, length)  # type: ignore[arg-type]
            self.prompts.append(long_prompt)
            prompts = [long_prompt] if cut_schedules(long_prompt, candidate) else []
        return bool(prompts) and all(
            _server_logprobs(self.server, prompt, [len(piece) for piece in pieces[:-1]]) == self._reference(prompt)
            for prompt in prompts
            for pieces in cut_schedules(prompt, candidate)
        )

    def _reference(self, prompt: list[int]) -> object:
        key = len(prompt)
        if key not in self._references:
            self._references[key] = _server_logprobs(self.server, prompt, [])
        return self._references[key]


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
    except UnexpectedReuse as error:
        return ("reused", error.expected, error.cached)
    return first_logprobs(server, prompt, end)


def first_logprobs(server: LlamaServer, prompt: list[int], cached: int = 0) -> object:
    """The first token's top log-probabilities of *prompt* in slot 0, going on from its
    first *cached* tokens (0: nothing reused), or a marker when the server reused other
    than that. The caller holds the whole server."""
    slot = InSlot(0)
    try:
        for _ in server.complete(
            prompt, Decoding(1), cache_prompt=bool(cached), n_probs=_PROBE_LOGPROBS, expected_cached=cached, slot=slot
        ):
            pass
    except UnexpectedReuse as error:
        return ("reused", error.expected, error.cached)
    return slot.completion.top_logprobs
