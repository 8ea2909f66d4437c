"""Slipstream operator: kopf handlers for InferenceService and OfflineJob."""
