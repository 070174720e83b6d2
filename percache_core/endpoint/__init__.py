"""``percache serve``: an OpenAI-compatible endpoint in front of a llama-server, so that
any OpenAI client (LangChain ``ChatOpenAI``, LlamaIndex ``OpenAILike``, the ``openai``
package, chat front-ends) gains PerCache by changing one URL.

:func:`create_app` builds the web application (:mod:`.app`) over an open
:class:`~percache_core.PerCache` whose engine is a llama-server; :func:`serve` runs it
until stopped and :func:`serving_in_thread` from a thread (:mod:`.serve`); :mod:`.protocol`
reads and writes the OpenAI protocol. Needs the ``serve`` extra (starlette, uvicorn, httpx).
"""

from .app import EndpointSettings
from .routes import create_app
from .serve import serve, serving_in_thread

__all__ = ["EndpointSettings", "create_app", "serve", "serving_in_thread"]
