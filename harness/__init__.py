"""What the tests and the benchmarks share: the served graph as a fixture (`server`), the reference
engine and tiny checkpoints (`reference`), and the peer processes multi-rank tests spawn."""
