"""The one forward path: every request that reaches a slot's upstream goes through here.

    handler: parse, validate, build an Exchange      (handlers/, exchange.py)
        dispatch.serve(request, model, exchange)     the model's plan (NoRoute 404) that the key
                                                     may take (Forbidden 403), each slot in turn
                                                     while it hands on (path.py)
            Forward.run(exchange)                    one slot: lease, open, classify, whole or
                                                     relay, release (attempt.py)

A handler never touches an upstream response: the exchange is its whole say in how the request
meets an upstream, and everything that is the same for every surface (hand-on, the stall guard,
the record of what the relay saw, the keepalive of a stream that waits: keepalive.py) is written
once, here. `modes.py` asks a slot's upstream whether it serves the Anthropic and Responses APIs
itself; `ollama_models.py` reads the Ollama API's model lists from the dispatch.
"""

from hal0d.forward.attempt import Forward, HandOn
from hal0d.forward.exchange import Answer, Attempt, Call, Exchange
from hal0d.forward.path import Dispatch

__all__ = ["Answer", "Attempt", "Call", "Dispatch", "Exchange", "Forward", "HandOn"]
