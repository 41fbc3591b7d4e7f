"""``python -m bench retry``: clients that honour Retry-After (the openai SDK) under 1.5x overload, computed hint vs fixed."""
