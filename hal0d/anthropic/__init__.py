"""The Anthropic Messages surface, translated to and from OpenAI chat completions (pure)."""
