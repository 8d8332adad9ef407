"""hal0d: one front door for the home lab's OpenAI-compatible LLM upstreams."""

# The one place the version is written: setup.cfg reads it (attr:), `hal0d --version` prints it,
# /healthz reports it and every request hal0d sends upstream names it in its User-Agent.
__version__ = "0.1.0"
USER_AGENT = f"hal0d/{__version__}"
