"""Serving: sampling, engine, scheduler, hybrid cache, OpenAI-compatible API."""
