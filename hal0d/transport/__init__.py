"""The way to an upstream and back: the one client, the relay loop, the stall guard, the tap."""
