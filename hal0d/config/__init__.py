"""Configuration: TOML in, frozen dataclasses out, every problem reported with its key path.

The rest of hal0d imports from here and needs to know nothing else. Inside, one module a concern:
  model.py        the dataclasses everything is handed (Config, SlotConfig, ...)
  reader.py       load and parse: the whole file checked before anything fails
  spec.py         what each table may hold, and the check of a table against it
  checks.py       slots, groups, routes, aliases, the Ollama listener, devices, allowed names
  client_keys.py  the keys clients present, their secrets read from where they are written
  anonymous.py    a listener's access for requests without a key (scopes, models, networks)
  duration.py     durations as Go and Ollama write them ("5m"), for every `*_s` key
  slot_command.py what a slot's command tells: its model files, llama-server's context split
  capabilities.py what a slot's models can do, as Ollama's clients ask (`capabilities`)
  ports.py        `{free_port}`: the port picked for a slot, the same one on every reload
  cache_dir.py    `{prompt_cache_dir}`: the folder of a slot's saved prompt caches
  render.py       print-config's TOML, every default filled in
"""

from hal0d.config.anonymous import ANONYMOUS, Network, networks_of
from hal0d.config.duration import go_duration
from hal0d.config.model import (
    KEY_SCOPES,
    REDACTED_SECRET,
    SLOT_TIMEOUT_KEYS,
    AnonymousConfig,
    Config,
    ConfigError,
    DevicesConfig,
    DispatcherConfig,
    GroupConfig,
    KeyConfig,
    MetricsConfig,
    OllamaConfig,
    RouteConfig,
    ServerConfig,
    SlotConfig,
    alias_target,
    is_loopback,
)
from hal0d.config.reader import load, parse
from hal0d.config.render import to_toml
from hal0d.config.slot_command import answer_name, context_split, model_files

__all__ = [
    "ANONYMOUS",
    "KEY_SCOPES",
    "REDACTED_SECRET",
    "SLOT_TIMEOUT_KEYS",
    "AnonymousConfig",
    "Config",
    "ConfigError",
    "DevicesConfig",
    "DispatcherConfig",
    "GroupConfig",
    "KeyConfig",
    "MetricsConfig",
    "Network",
    "OllamaConfig",
    "RouteConfig",
    "ServerConfig",
    "SlotConfig",
    "alias_target",
    "answer_name",
    "context_split",
    "go_duration",
    "is_loopback",
    "load",
    "model_files",
    "networks_of",
    "parse",
    "to_toml",
]
