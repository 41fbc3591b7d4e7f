"""``python -m bench trace``: real traces replayed in virtual time, per class, beside round robin and a hand split."""
