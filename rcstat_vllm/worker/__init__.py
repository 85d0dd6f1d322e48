"""The worker side: per-step driver, request records, prompt and decode compression jobs."""
