"""The request limits both surfaces enforce alike (pure: the Anthropic protocol modules use it)."""

MAX_TOKENS_LIMIT = 1_000_000  # no local model generates more in one answer
MAX_MESSAGES = 100_000  # a conversation this long is a bug or an attack, not a chat
