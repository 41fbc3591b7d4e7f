"""The real-vLLM suite: tailguard in front of real vLLM engines (``.ci/real-vllm`` runs it)."""
