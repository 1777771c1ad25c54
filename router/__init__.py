"""kvpilot.router — the cache-aware routing sidecar."""
