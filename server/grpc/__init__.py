"""The gRPC wire: the ``tailguard.v1.Completions`` front end on grpc.aio, the asyncio bridge to Trio, and the generated code."""
