"""Every object the application shares, as a typed web.AppKey, in one place.

Below the handlers (which read them) and above the modules whose types they name: the wiring
lives in contexts.py, which builds these objects.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from hal0d.front.heads import HeadWatch
from hal0d.front.surfaces import Surfaces
from hal0d.keys import KeyLimits
from hal0d.lifecycle.table import SlotTable
from hal0d.response_owners import ResponseOwners
from hal0d.routing import RuntimeRef
from hal0d.shares.book import ShareBook

if TYPE_CHECKING:
    from hal0d.devices import Devices
    from hal0d.forward import Dispatch
    from hal0d.forward.ollama_models import OllamaModels
    from hal0d.lifecycle.manager import LifecycleManager
    from hal0d.observability.events import EventHub, SlotViews
    from hal0d.observability.recorder import Recorder
    from hal0d.observability.timeline import Timeline


RUNTIME = web.AppKey("runtime", RuntimeRef)
SLOTS = web.AppKey("slots", SlotTable)
# Every slot's lifecycle: its process, its probe, loads and unloads, reloads.
LIFECYCLE: web.AppKey[LifecycleManager] = web.AppKey("lifecycle")
# What the forward path works with: the slots, the one upstream client, the token counter, the
# streams being relayed (forward.Dispatch).
DISPATCH: web.AppKey[Dispatch] = web.AppKey("dispatch")
RECORDER: web.AppKey[Recorder] = web.AppKey("recorder")
# The connections that never sent a whole first request head, closed after header_timeout_s.
HEADS = web.AppKey("heads", HeadWatch)
# The readers of GET /api/events.
EVENTS: web.AppKey[EventHub] = web.AppKey("events")
# A slot's view as /api/slots and the feed show it (the lifecycle's, with its load's phase).
VIEWS: web.AppKey[SlotViews] = web.AppKey("views")
# Which model made each Responses API answer (bounded): GET/DELETE /v1/responses/{id} go there.
RESPONSE_OWNERS = web.AppKey("response_owners", ResponseOwners)
# What each named key is doing now (its model calls in flight and of the last minute): one for
# the process, so a reload keeps the counts.
KEY_LIMITS = web.AppKey("key_limits", KeyLimits)
# The tokens each key used lately, which the slots' queues weigh keys by (hal0d/shares): one for
# the process, charged when a request ends.
SHARE_BOOK = web.AppKey("share_book", ShareBook)
# Each route's surface (its error envelope, its key scope, whether it is a model call), and the
# Ollama listener's port when it is on: what the lifecycle middleware asks of a request's route.
SURFACES = web.AppKey("surfaces", Surfaces)
# The (client, option) pairs of Ollama requests whose ignored option was logged
# (`ollama.option_ignored`, once each): the app's own, so another app logs its clients anew.
OLLAMA_OPTIONS_LOGGED: web.AppKey[set[tuple[str, str]]] = web.AppKey("ollama_options_logged")
# The Ollama API's model lists (/api/tags, /api/show, /api/ps), read from the dispatch.
OLLAMA_MODELS: web.AppKey[OllamaModels] = web.AppKey("ollama_models")
# The last hour of loads and unloads, and the groups' free memory, for GET /api/timeline.
TIMELINE: web.AppKey[Timeline] = web.AppKey("timeline")
# Each GPU's memory and who holds it, read while hal0d runs (GET /api/devices, /metrics).
DEVICES: web.AppKey[Devices] = web.AppKey("devices")

# Set by `hal0d serve`: read the config file again, its [[library]] sources rescanned, and
# return once that reload is done (POST /api/library/rescan; the same as a SIGHUP).
RESCAN: web.AppKey[Callable[[], Awaitable[None]]] = web.AppKey("rescan")
