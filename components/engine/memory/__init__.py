"""Device and host memory a rank manages: the VMM arena, the stack reserve, pinned host pages."""
