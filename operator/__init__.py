"""kvpilot.operator — the Kopf operator for InferenceService."""
