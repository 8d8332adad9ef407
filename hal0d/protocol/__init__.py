"""Pure protocol code: SSE framing, the Transform a relayed stream goes through, the limits, and
the one reading of an upstream's chat-completion stream chunk that every translator shares."""
