"""The model library: what the model files on this machine are, read from the files themselves.

One module a concern:
  gguf_facts.py   what a GGUF file says about itself (architecture, size, quantization, context,
                  attention shape, chat template) and the memory it takes under llama-server
"""

from hal0d.library.gguf_facts import ModelFacts, UnreadableModel, read_facts

__all__ = ["ModelFacts", "UnreadableModel", "read_facts"]
