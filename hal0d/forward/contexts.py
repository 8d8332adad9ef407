"""Each slot's context: how many tokens one request may use there, prompt and answer together.

    config    the slot's `context` key: the operator's word wins
    server    what its server says of itself: llama-server's /props `n_ctx` (a server slot's
              context: `-c` divided by `--parallel` unless the KV cache is unified), vLLM's
              `max_model_len` in /v1/models (transport/props.py asks, once per run of the
              process; while the slot is not up, its last process's answer stands)
    gguf      a `[[library]]` model's context, as its command gives it (`-c {context}`: the
              library's `context`, at most what the model was trained for)
    unknown   none of these: nothing is guarded, the server's own error is mapped

Asking a server hal0d runs costs the first request of each run of its process one GET (two on
vLLM, bounded by props.PROPS_TIMEOUT_S); every later one, a dict lookup. A server hal0d does not
run is asked only by the model lists (Ollama's /api/show, /api/tags, /api/ps), as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from hal0d.config import SlotConfig
from hal0d.lifecycle.table import SlotTable
from hal0d.lifecycle.vocabulary import UP
from hal0d.ollama import capabilities
from hal0d.transport.props import UpstreamProps
from hal0d.transport.upstream import UpstreamClient

CONFIG, SERVER, GGUF = "config", "server", "gguf"


@dataclass(frozen=True, slots=True)
class Context:
    tokens: int
    source: str  # CONFIG, SERVER or GGUF

    def view(self) -> dict[str, object]:
        return {"tokens": self.tokens, "source": self.source}


class Contexts:
    """What each slot's context is (the module's docstring), for the guard and the model
    lists; the one keeper of the servers' self-descriptions (`props`)."""

    def __init__(self, slots: SlotTable, upstreams: UpstreamClient,
                 props: UpstreamProps | None = None) -> None:
        self.slots = slots
        self.upstreams = upstreams
        self.props = props or UpstreamProps()

    async def of(self, config: SlotConfig) -> Context | None:
        """The slot's context; a server hal0d runs asked when it is up and was not asked yet
        (once per run of its process). A server it does not run is not asked on a request's
        way (a remote provider is sent nothing but requests): what the model lists learnt of
        it stands."""
        if config.context:
            return Context(config.context, CONFIG)
        if not config.command:
            return self.known(config)
        return self.from_server(await self.server_props(config), config)

    def known(self, config: SlotConfig) -> Context | None:
        """The slot's context by what is known now, nothing asked (the operator's views)."""
        return self.from_server(self.props.last(config), config)

    async def server_props(self, config: SlotConfig) -> dict[str, object] | None:
        """What the slot's server says of itself: asked of a process that is up, else its last
        process's answer."""
        live = self.slots.get(config.name)
        if live is not None and live.state in UP:
            return await self.props.of(self.upstreams, config, live.generation)
        return self.props.last(config)

    @staticmethod
    def from_server(props: dict[str, object] | None, config: SlotConfig) -> Context | None:
        """The context by what the server said (`props`), else by the slot's library model."""
        if config.context:
            return Context(config.context, CONFIG)
        if tokens := capabilities.context_length(props):
            return Context(tokens, SERVER)
        if config.library is not None and config.library.context:
            return Context(config.library.context, GGUF)
        return None
