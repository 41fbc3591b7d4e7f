"""``python -m bench health``: a half-dead engine (``/health`` fine, work hung) per health_check, in virtual time."""
