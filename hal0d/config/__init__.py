"""Configuration: TOML in, frozen dataclasses out, every problem reported with its key path.

The rest of hal0d imports from here and needs to know nothing else. Inside, one module a concern:
  model.py        the dataclasses everything is handed (Config, SlotConfig, ...)
  reader.py       load and parse: the whole file checked before anything fails
  spec.py         what each table may hold, and the check of a table against it
  checks.py       slots, groups, routes, aliases, the Ollama listener, allowed names
  client_keys.py  the keys clients present, their secrets read from where they are written
  ports.py        `{free_port}`: the port picked for a slot, the same one on every reload
  cache_dir.py    `{prompt_cache_dir}`: the folder of a slot's saved prompt caches
  render.py       print-config's TOML, every default filled in
"""

from hal0d.config.model import (
    KEY_SCOPES,
    SLOT_TIMEOUT_KEYS,
    Config,
    ConfigError,
    DispatcherConfig,
    GroupConfig,
    KeyConfig,
    MetricsConfig,
    OllamaConfig,
    RouteConfig,
    ServerConfig,
    SlotConfig,
    alias_target,
)
from hal0d.config.reader import load, parse
from hal0d.config.render import to_toml

__all__ = [
    "KEY_SCOPES",
    "SLOT_TIMEOUT_KEYS",
    "Config",
    "ConfigError",
    "DispatcherConfig",
    "GroupConfig",
    "KeyConfig",
    "MetricsConfig",
    "OllamaConfig",
    "RouteConfig",
    "ServerConfig",
    "SlotConfig",
    "alias_target",
    "load",
    "parse",
    "to_toml",
]
