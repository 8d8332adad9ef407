"""Pure protocol code: SSE framing, the Transform a relayed stream goes through, the limits, the
one reading of an upstream's chat-completion stream chunk that every translator shares, and of
how much of a prompt the upstream took from its cache (usage)."""
