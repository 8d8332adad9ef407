"""Pure protocol code: SSE framing, the Transform a relayed stream goes through, the limits."""
