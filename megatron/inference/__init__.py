"""Serving a trained model: generation-tool start-up, the scheduler loop, and the REST server."""
