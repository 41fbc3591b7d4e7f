"""``python -m bench lendback``: where borrowed seats go, measured in virtual time."""
