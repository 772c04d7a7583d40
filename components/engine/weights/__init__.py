"""Weight transfer: the store a pull reads from and writes to, same-node mapping, checksums."""
