"""The configuration as the rest of hal0d is handed it: frozen dataclasses, one per TOML table.

They hold no checking, no file reading and no rendering, so a `Config` built by hand (as the
tests do) is the same thing `load` returns. Beside them: the error that lists every problem
found, the constants the dataclasses answer by (a slot's start modes, a group's policies, the
timeouts a slot may set, a key's scopes) and the readings of their values that run while
serving (a `host:port`, a loopback host, a model alias).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(Exception):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


KEY_SCOPES = ("inference", "read", "admin")
# What a request without a key may be let do: never admin (loading and unloading for anyone).
ANONYMOUS_SCOPES = KEY_SCOPES[:2]
KEY_SECRET_SOURCES = ("key", "key_env", "key_file")
# What print-config writes in place of a secret; a config that carries it is refused, so a
# printed file loaded again never runs with this word as a key.
REDACTED_SECRET = "<redacted>"


@dataclass(frozen=True, slots=True)
class AnonymousConfig:
    """A listener's `anonymous` table: what a request that carries no key may do there (its
    scopes and model globs, as a key's), and from which source addresses (`networks`, CIDR
    ranges; None: loopback alone). A request with a key is judged by its key alone."""

    scopes: tuple[str, ...]
    models: tuple[str, ...] | None = None
    networks: tuple[str, ...] | None = None
    # Its share of the box, as a key's (hal0d/shares): one account named "anonymous".
    service_class: str = field(default="interactive", metadata={"toml": "class"})
    weight: float = 1.0
    tokens_per_hour: int | None = None
    tokens_per_day: int | None = None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # listen(2)'s queue of connections not yet accepted; the kernel clips it to somaxconn.
    backlog: int = 2048
    shutdown_grace_s: float = 30.0
    # A connection that has not sent a whole first request head within this is closed.
    header_timeout_s: float = 10.0
    # An idle keep-alive connection is closed after this (aiohttp's own bound).
    keepalive_timeout_s: float = 75.0
    max_body_bytes: int = 32 * 1024 * 1024
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    protect_metrics: bool = False
    # Host names (beyond loopback and the listening address) and browser origins let in.
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    # Requests without a key on this listener, beside the keys (None: they get a 401).
    anonymous: AnonymousConfig | None = None
    # The keys clients may present: api_keys plus the lines of api_keys_file, read at load time.
    # Kept out of repr and of print-config's output.
    accepted_keys: frozenset[str] = field(default=frozenset(), repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class DispatcherConfig:
    """The `[dispatcher]` section: the bounds on a request's way to its upstream. It holds
    timeouts (and the two bounds of a shared box's turns), so code that is handed one (often a
    slot's effective copy, SlotConfig.timeouts()) names it `timeouts`."""

    direct_read_timeout_s: float = 300.0
    stream_total_timeout_s: float = 900.0
    stream_idle_timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    write_timeout_s: float = 10.0
    pool_timeout_s: float = 5.0
    # A streamed request that waited this long with nothing to send (its queue, a load, the
    # prefill) gets its response head and then, this often, its surface's keepalive: clients
    # with an idle read timeout do not give up while the box works. 0 = off. Half of a common
    # client read timeout (10 s): at 10 the first keepalive lands just after such a client gave
    # up (its timer starts before hal0d's), as the bench's keepalive rows show.
    keepalive_s: float = 5.0
    # A batch request that waited this long goes ahead of interactive work (hal0d/shares):
    # batch is served after interactive work, never starved.
    batch_max_wait_s: float = 120.0
    # Keys of one class are served in proportion to their weights, counted in the tokens each
    # used over this window.
    share_window_s: float = 600.0


START_ALWAYS = "always"
PROMPT_CACHE_SAVE = "save"
PROMPT_CACHE_MODES = ("off", PROMPT_CACHE_SAVE)
START_ON_DEMAND = "on_demand"
# The keys that only mean something for a slot hal0d starts and stops itself (it has a command).
LIFECYCLE_KEYS = ("idle_unload_s", "group", "load_timeout_s", "prompt_cache", "save_timeout_s",
                  "prompt_cache_max_mib", "devices")
# The keys that only mean something for a slot hal0d stops when it is idle (start = "on_demand").
ON_DEMAND_KEYS = ("idle_unload_s",)

# The [dispatcher] timeouts a slot may set for itself.
SLOT_TIMEOUT_KEYS = ("direct_read_timeout_s", "stream_total_timeout_s", "stream_idle_timeout_s",
                     "keepalive_s")


@dataclass(frozen=True, slots=True)
class LibraryEntry:
    """What a slot made from a model file a `[[library]]` found knows of that file: where it was
    found and what its GGUF header says (hal0d/library). The Ollama lists, `hal0d models` and
    the page show it; `table` is the slot table it was made from, as `hal0d models --config`
    prints it for a user who pins it by hand ({free_port} and {prompt_cache_dir} unfilled: the
    slot's own port and folder are picked as it is read)."""

    names: tuple[str, ...]
    source: str
    file: str
    mmproj: str | None
    size_bytes: int
    modified_at: float
    family: str
    parameters: int
    parameter_size: str
    quantization: str
    trained_context: int | None
    context: int
    estimate_mib: int
    chat_template: str | None  # what its model can do is read from it (ollama/capabilities.py)
    table: tuple[tuple[str, object], ...]


@dataclass(frozen=True, slots=True)
class SlotConfig:
    name: str
    upstream: str
    models: tuple[str, ...]
    max_concurrent: int = 8
    max_queue: int = 32
    queue_timeout_s: float = 30.0
    api_key: str | None = None
    api_key_env: str | None = None
    command: tuple[str, ...] | None = None
    max_output_tokens: int | None = None
    # The tokens a request may use here (prompt and answer): what its server says (/props,
    # max_model_len) when unset (forward/contexts.py).
    context: int | None = None
    # This slot's own stall and read bounds; None means the [dispatcher] value. A remote
    # provider and a local 70B model deserve different bounds, and so does the demo's stub.
    direct_read_timeout_s: float | None = None
    stream_total_timeout_s: float | None = None
    stream_idle_timeout_s: float | None = None
    keepalive_s: float | None = None
    # Model lifecycle: "always" starts the command with hal0d and keeps it up; "on_demand" starts
    # it for the first request and stops it after idle_unload_s with nothing to do (0 = never).
    start: str = "always"
    idle_unload_s: float = 0.0
    load_timeout_s: float = 600.0
    group: str | None = None
    memory_mib: int | None = None
    # The devices its loads may go to (devices/placement.py; indexes as /api/devices shows
    # them); None: any.
    devices: tuple[int, ...] | None = None
    # The Anthropic Messages surface for this slot's models: "translate" (to chat completions),
    # "native" (relayed raw to the upstream's own /v1/messages), "auto" (native when it has one).
    anthropic: str = "translate"
    # The Responses API for this slot's models: "native" (relayed raw to the upstream's own
    # /v1/responses), "translate" (to chat completions), "auto" (native when it has one).
    responses: str = "native"
    # "openai": an OpenAI-compatible server; "hal0d": another hal0d, whose models' states are
    # followed (lifecycle/remote.py) so a route's prefer_loaded knows what is loaded there.
    kind: str = "openai"
    # "save": before hal0d stops the process it saves the server's prompt caches into
    # prompt_cache_dir (llama-server: --slot-save-path {prompt_cache_dir}), and restores them
    # after the next load; "off": a stop loses them. A save is bounded by save_timeout_s (a
    # restore too), the folder by prompt_cache_max_mib (oldest files go first).
    prompt_cache: str = "off"
    save_timeout_s: float = 5.0
    prompt_cache_max_mib: int = 8192
    # The folder `{prompt_cache_dir}` in the command stands for (config/cache_dir.py): one per
    # slot and command, so a file is only ever restored into what saved it. None: not named.
    prompt_cache_dir: str | None = None
    # What the models can do, as Ollama's clients ask (config/capabilities.py): per model, as
    # declared; a model not named is what its upstream says of itself.
    capabilities: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # A slot a [[library]] made from a model file it found (None: written by hand). Out of
    # print-config's output (it prints the [[library]] table) and of comparisons (the command
    # names the file: a file changed is a command changed).
    library: LibraryEntry | None = field(default=None, repr=False, compare=False)

    def declared_capabilities(self, model: str) -> tuple[str, ...] | None:
        return next((names for named, names in self.capabilities if named == model), None)

    @property
    def saves_prompt_cache(self) -> bool:
        return self.prompt_cache == PROMPT_CACHE_SAVE and self.prompt_cache_dir is not None

    @property
    def on_demand(self) -> bool:
        return self.start == START_ON_DEMAND

    def timeouts(self, dispatcher: DispatcherConfig) -> DispatcherConfig:
        """The timeouts this slot's requests run on: `dispatcher` with the slot's own bounds
        in place of the ones it sets (the very same object when it sets none)."""
        own = {
            key: value for key in SLOT_TIMEOUT_KEYS if (value := getattr(self, key)) is not None
        }
        return dataclasses.replace(dispatcher, **own) if own else dispatcher

    def bearer_token(self) -> str | None:
        if self.api_key is not None:
            return self.api_key
        if self.api_key_env is not None:
            return os.environ.get(self.api_key_env)
        return None


POLICY_BATCH = "batch"
POLICY_FIFO = "fifo"


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """Slots that share a device: at most `max_loaded` of them loaded at once, the sum of their
    `memory_mib` within `memory_mib`, and each load only when `free_memory_command` reports room.
    `policy` says when a model waiting for room may unload a busy one: `batch` once the busy
    one's turn is over, a turn priced by what a swap measurably costs so that swapping takes at
    most `max_swap_share` of the group's time (at least `min_turn_loads` times its own measured
    load; `max_wait_s`, when set, ends a turn once another model's request waited that long),
    `fifo` at once (room.py)."""

    name: str
    max_loaded: int | None = None
    memory_mib: int | None = None
    free_memory_command: tuple[str, ...] | None = None
    policy: str = "batch"
    max_swap_share: float = 0.2
    max_wait_s: float | None = None
    min_turn_loads: float = 3.0

    @property
    def batch(self) -> bool:
        return self.policy == POLICY_BATCH


# The room kept free on each device by default: what a model's estimate may be short of what its
# load really takes (GPUStack settled on about 1 GB after its estimates came out too low).
DEVICES_MARGIN_MIB = 512


@dataclass(frozen=True, slots=True)
class DevicesConfig:
    """The `[devices]` section: how hal0d reads each GPU's memory (hal0d/devices). Without
    `devices_command` it asks NVIDIA's NVML, then AMD's amdsmi; with it, that program alone.
    `margin_mib` is the room to keep free on each device when a load is placed, `margins_mib`
    a device's own (device index -> MiB)."""

    devices_command: tuple[str, ...] | None = None
    margin_mib: int = DEVICES_MARGIN_MIB
    margins_mib: Mapping[int, int] = field(default_factory=dict)
    read_interval_s: float = 5.0


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    database: str = "hal0d-history.sqlite3"
    retention_days: int = 30
    ttft_samples: int = 256


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    level: str = "info"
    format: str = "auto"


@dataclass(frozen=True, slots=True)
class RouteConfig:
    """A `[[routes]]` table: one model name served by several slots, tried in order while
    nothing has reached the client (hal0d.forward)."""

    model: str
    slots: tuple[str, ...]
    # The model name each slot is asked for; a slot not named here is asked for `model`.
    served: dict[str, str] = field(default_factory=dict)
    first_byte_timeout_s: float = 0.0  # 0 = off
    spill_when_busy: bool = False
    prefer_loaded: bool = False

    def served_by(self, slot: str) -> str:
        return self.served.get(slot, self.model)


@dataclass(frozen=True, slots=True)
class OllamaConfig:
    """The `[ollama]` section: a second listener that speaks Ollama's API (off unless set)."""

    listen: str | None = None  # "host:port", e.g. "127.0.0.1:11434"
    # Requests without a key on this listener (Home Assistant sends none), beside the keys.
    anonymous: AnonymousConfig | None = None
    # A conversation longer than the model's context loses its oldest messages, as Ollama's
    # does (said in the log and the history); false: refused with Ollama's error instead.
    truncate: bool = True

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) of `listen` (an IPv6 host without its brackets), None when off."""
        return None if self.listen is None else split_address(self.listen)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 without brackets) is this machine alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_address(listen: str) -> tuple[str, int] | None:
    """`host:port` (`[::1]:11434` for IPv6) as (host, port); None when it is no such thing."""
    host, colon, port = listen.rpartition(":")
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None  # an IPv6 address needs its brackets before the port
    return (host, int(port)) if host and " " not in host else None


@dataclass(frozen=True, slots=True)
class KeyConfig:
    """A `[[keys]]` table: a client key with a name (shown in the history, the log and /metrics
    instead of the key), what it may reach and how much at once (hal0d.keys)."""

    name: str
    scopes: tuple[str, ...]
    # Where the secret comes from: one of the three (systemd credentials: key_file =
    # "${CREDENTIALS_DIRECTORY}/NAME").
    key: str | None = None
    key_env: str | None = None
    key_file: str | None = None
    models: tuple[str, ...] | None = None  # globs of the model names it may use
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    # Its share of the box (hal0d/shares): `class` in the table, interactive or batch; its
    # weight among the keys of its class; its token quotas.
    service_class: str = field(default="interactive", metadata={"toml": "class"})
    weight: float = 1.0
    tokens_per_hour: int | None = None
    tokens_per_day: int | None = None
    # The secret itself, read from its source at load time; never printed.
    secret: str = field(default="", repr=False)


# What a [[library]] table's models start as unless it says otherwise: loaded for their first
# request and unloaded after five idle minutes (as Ollama does), with a context of 8192 tokens
# or the model's own when smaller.
LIBRARY_IDLE_UNLOAD_S = 300.0
LIBRARY_CONTEXT = 8192


@dataclass(frozen=True, slots=True)
class LibraryConfig:
    """A `[[library]]` table: a source of model files (a folder, "ollama" or an Ollama store's
    folder, "hf" or a Hugging Face cache's folder), each model found served by a slot of its
    own made from `command` (its placeholders filled per model) and `defaults`, the table's
    other slot keys (hal0d/library/slots.py)."""

    path: str
    command: tuple[str, ...] | None = None
    context: int = LIBRARY_CONTEXT
    defaults: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    dispatcher: DispatcherConfig = field(default_factory=DispatcherConfig)
    slots: tuple[SlotConfig, ...] = ()
    groups: dict[str, GroupConfig] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    keys: tuple[KeyConfig, ...] = ()
    routes: tuple[RouteConfig, ...] = ()
    ollama: OllamaConfig = field(default_factory=OllamaConfig)
    library: tuple[LibraryConfig, ...] = ()
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    # What the [[library]] sources hold that is not served (a truncated file, a manifest naming
    # a missing blob, a name two sources claim): warnings, one line each; the rest is served.
    library_problems: tuple[str, ...] = field(default=(), compare=False)
    # The folder relative paths (the metrics database) resolve against.
    base_dir: Path = field(default_factory=Path.cwd, compare=False)

    def database_path(self) -> Path:
        path = Path(self.metrics.database)
        return path if path.is_absolute() else self.base_dir / path


def alias_target(aliases: dict[str, str], model: str) -> str | None:
    """The served model an alias pattern maps `model` to; exact names win over globs."""
    if model in aliases:
        return aliases[model]
    for pattern, target in aliases.items():
        if fnmatch.fnmatchcase(model, pattern):
            return target
    return None
