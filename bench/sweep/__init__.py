"""``python -m bench sweep``: the policy in virtual time: loads x set-ups x splits."""
