"""HTTP handlers, one module per surface; they stay thin and hand work to the rooms behind."""
