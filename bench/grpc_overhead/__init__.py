"""``python -m bench grpc_overhead``: the gRPC front end: unary calls, streams, 10,000 open streams."""
