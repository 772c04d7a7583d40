"""The expert-parallel exchange: the communicator protocol and its errors, its transports, the expert map."""
