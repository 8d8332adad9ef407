"""hal0d: one front door for the home lab's OpenAI-compatible LLM upstreams."""
