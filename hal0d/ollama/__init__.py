"""The Ollama API, translated to and from OpenAI chat completions and embeddings (pure)."""
