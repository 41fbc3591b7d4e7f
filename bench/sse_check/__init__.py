"""``python -m bench sse_check``: in process: what the HTTP relay's check of every SSE event costs per event."""
