"""kvpilot.engine.model."""
