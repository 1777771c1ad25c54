"""kvpilot.engine.sampling."""
