"""Replay buffer: ingest, admission control, staleness, accounting, batch serving."""
