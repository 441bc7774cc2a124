"""The engine: one round loop, the server, client training, sampling, aggregation, payloads."""
