"""kvpilot.engine.kv."""
