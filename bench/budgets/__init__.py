"""``python -m bench budgets``: one token budget shared by four tailguard replicas on one Redis (issue 24)."""
