"""The OpenAI surface's stream frames: the relay's passthrough transform and hal0d's own endings.

The HTTP handler for the surface is hal0d/handlers/openai.py; this package holds what it writes
into a stream, so that the relay and the stall guard know no surface (pure, like hal0d.anthropic).
"""
