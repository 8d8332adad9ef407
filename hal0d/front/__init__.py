"""The front door: what every connection and request passes before a handler."""
