"""``python -m bench cluster``: replicas sharing caps on Redis: caps under load, kill -9, Redis down."""
