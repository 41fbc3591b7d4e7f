"""``python -m bench tenants``: two API keys on one small pool, fair shares against first come first served."""
