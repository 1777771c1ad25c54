"""kvpilot.bench — benchmark tools behind ``kvpilot bench``."""
