"""The HTTP wire: tailguard's own HTTP/1.1 server, the OpenAI-compatible front end on it, and the watch on callers who leave."""
