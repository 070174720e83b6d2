"""A clear error when langchain-core is missing."""

from percache_core import missing_dependency


def require_langchain() -> None:
    try:
        import langchain_core  # noqa: F401
    except ImportError as error:
        raise missing_dependency("langchain-core", "percache-langchain") from error
