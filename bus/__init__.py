"""Messaging plane: a thin typed layer over nats-py, subjects, JetStream and nats-server."""
