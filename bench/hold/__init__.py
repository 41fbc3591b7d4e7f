"""``python -m bench hold``: RSS while holding 10,000 HTTP SSE streams; GC pauses under relay, per GC threshold."""
