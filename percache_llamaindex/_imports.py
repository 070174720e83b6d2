"""A clear error when LlamaIndex is missing."""

from percache_core import missing_dependency


def require_llama_index() -> None:
    try:
        import llama_index.core  # noqa: F401
    except ImportError as error:
        raise missing_dependency("llama-index-core", "percache-llamaindex") from error
