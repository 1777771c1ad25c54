"""kvpilot.engine.server."""
