"""What the tests share, by concern; tests/conftest.py holds only the fixtures, built on these, and
no test module imports another (tests/test_imports.py holds that).

- poll: the one poller, `eventually` (and `eventually_sync` without an event loop).
- ports: free loopback ports.
- processes: /proc: whether a process runs, the stub processes of a test, leftovers.
- stubs: what stands in for a model server: the stub, purpose-built upstreams, stream pieces.
- config: the one Config builder (`build_config`, `make_config`) and the TOML of a `hal0d serve`.
- daemons: hal0d in process (a TestServer), as a process with asyncio (`Hal0dProcess`), and as
  one for a test without an event loop (`Hal0dPopen`).
- client: asking a daemon as its clients do: bodies, chats, slot views and states, streams, the
  event feed, a POSTed stream read by an independent SSE client.
- observe: what a daemon reports: /metrics, the history, the per-slot figures.
- logs: hal0d's own logging pipeline into a buffer.
- cli: hal0d's command line, run for real.
- page: the status page's browser and daemon.
- model_stores: model stores on disk as their owners write them: a folder of GGUF files,
  Ollama's store, the Hugging Face cache.
- gguf_files: small real GGUF models (split in parts, too) and vision projectors.
- anthropic_stream: OpenAI chunks built short and played through the Anthropic translator, its
  events read short; any upstream stream (hypothesis); the anthropic SDK reading our frames.
- anthropic_request: the smallest valid Anthropic Messages request body, for the parser's tests.
- anthropic_surface: the Messages surface's request body, its wire read strictly and folded, its
  error envelope, and an upstream that writes chat completion chunks as a script says.
- keys: the scoped keys of the keys tests, hal0d with them, a request made with one.
- responses_bridge: a Responses request translated for a chat upstream, and Codex's tools.
- swaps: a group of max_loaded = 1, two stub models in it, a sampler of every pid it loaded.
- slots: a slot outside a daemon, its config stand-in and an observer that keeps its changes.
- stallguard: the guard's bounds, a response as the client received it chunk by chunk, the stall
  frame read back and checked.
"""
