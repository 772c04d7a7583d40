"""The graph runner: the component contract, `dynamo serve` and its supervisor, the Dynamo runtime."""
