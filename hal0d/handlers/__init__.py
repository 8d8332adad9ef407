"""HTTP handlers, one module per surface; they stay thin and hand the work to the modules behind
them (routing, slots, upstream, relay, and the surface's own translation)."""
